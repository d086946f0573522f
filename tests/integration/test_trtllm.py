"""TensorRT-LLM checkpoint export: a forward written from the layout alone, run rank by rank on the
``rank{i}.safetensors`` shards (column-parallel outputs concatenated, row-parallel outputs summed,
as TensorRT-LLM's tensor parallelism computes), must give ``transformers``' logits on the same weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_orchestra.config import ModelConfig, load_config
from nemo_orchestra.export.qwen3 import hf_to_megatron, model_config_from_hf
from nemo_orchestra.export.trtllm import export_trtllm

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 250  # not a multiple of 4: the lm_head is padded for tp=4


def _hf_model(qk_norm: bool, tied: bool, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if qk_norm else (LlamaConfig, LlamaForCausalLM)
    config = cfg_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    config.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms start at 1: perturb them so a swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _export(model, tmp_path, tp: int) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    from safetensors.torch import load_file

    base = load_config([]).model
    mcfg: ModelConfig = model_config_from_hf(
        model.config.to_dict() | {"architectures": model.config.architectures}, base
    )
    state = hf_to_megatron(model.state_dict(), mcfg)
    out = export_trtllm(state, mcfg, VOCAB, str(tmp_path / f"trt_tp{tp}"), tp=tp, dtype=torch.float32)
    config = json.loads(Path(out, "config.json").read_text())
    return config, [load_file(os.path.join(out, f"rank{r}.safetensors")) for r in range(tp)]


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x_TND, theta: float):
    t, _, d = x_TND.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]  # gpt-neox: rotate halves
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x_TND[..., : d // 2], x_TND[..., d // 2 :]
    return x_TND * cos + torch.cat([-x2, x1], -1) * sin


def _attention(ranks, cfg, i, x_TH):
    """attention.qkv / q_layernorm / k_layernorm / dense of layer i, summed over the TP ranks."""
    tp, d = cfg["mapping"]["tp_size"], cfg["head_size"]
    hq, hkv = cfg["num_attention_heads"] // tp, max(cfg["num_key_value_heads"] // tp, 1)
    t, out = x_TH.shape[0], 0
    for w in ranks:
        p = f"transformer.layers.{i}.attention."
        qkv = x_TH @ w[p + "qkv.weight"].double().T
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
        q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
        if cfg.get("qk_layernorm"):
            q = _rms(q, w[p + "q_layernorm.weight"].double(), cfg["norm_epsilon"])
            k = _rms(k, w[p + "k_layernorm.weight"].double(), cfg["norm_epsilon"])
        q, k = _rope(q, cfg["rotary_base"]), _rope(k, cfg["rotary_base"])
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, hq * d)
        out = out + o @ w[p + "dense.weight"].double().T  # row parallel: partial sums
    return out


def _mlp(ranks, i, x_TH):
    out = 0
    for w in ranks:
        p = f"transformer.layers.{i}.mlp."
        fc, gate = x_TH @ w[p + "fc.weight"].double().T, x_TH @ w[p + "gate.weight"].double().T
        out = out + (torch.nn.functional.silu(fc) * gate) @ w[p + "proj.weight"].double().T
    return out


def trtllm_forward(cfg: dict, ranks: list[dict[str, torch.Tensor]], ids: list[int]) -> torch.Tensor:
    """Logits [T, V] computed from a TensorRT-LLM checkpoint's config and per-rank weights."""
    eps, w0 = cfg["norm_epsilon"], ranks[0]
    x = w0["transformer.vocab_embedding.weight"].double()[torch.tensor(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.layers.{i}."
        x = x + _attention(ranks, cfg, i, _rms(x, w0[p + "input_layernorm.weight"].double(), eps))
        x = x + _mlp(ranks, i, _rms(x, w0[p + "post_layernorm.weight"].double(), eps))
    x = _rms(x, w0["transformer.ln_f.weight"].double(), eps)
    logits = torch.cat([x @ w["lm_head.weight"].double().T for w in ranks], -1)  # column parallel
    return logits[:, : cfg["vocab_size"]]


@pytest.mark.parametrize(
    "qk_norm,tied,kv_heads,tp", [(True, False, 2, 1), (True, False, 2, 2), (True, True, 2, 4), (False, False, 4, 2)]
)
def test_trtllm_layout_forward_equals_transformers(tmp_path, qk_norm, tied, kv_heads, tp):
    model = _hf_model(qk_norm, tied, kv_heads)
    cfg, ranks = _export(model, tmp_path, tp)
    ids = [3, 17, 42, 99, 5, 200, 7, 1]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double()
    got = trtllm_forward(cfg, ranks, ids)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_trtllm_config_and_shards(tmp_path):
    model = _hf_model(qk_norm=True, tied=True, kv_heads=2)
    cfg, ranks = _export(model, tmp_path, tp=4)  # 2 KV heads over 4 ranks: each is repeated twice
    assert cfg["architecture"] == "Qwen3ForCausalLM" and cfg["qwen_type"] == "qwen3" and cfg["dtype"] == "float32"
    assert cfg["mapping"] == {"world_size": 4, "tp_size": 4, "pp_size": 1, "cp_size": 1}
    assert cfg["vocab_size"] == VOCAB and cfg["num_key_value_heads"] == 2 and cfg["head_size"] == 16
    w = ranks[1]
    assert w["transformer.layers.0.attention.qkv.weight"].shape == ((1 + 1 + 1) * 16, 64)  # 1 q, 1 k, 1 v head
    assert w["transformer.layers.0.attention.dense.weight"].shape == (64, 16)
    assert w["transformer.layers.0.mlp.fc.weight"].shape == (24, 64)
    assert w["lm_head.weight"].shape == (63, 64)  # 250 padded to 252 over 4 ranks
    assert torch.equal(ranks[3]["lm_head.weight"][-2:], torch.zeros(2, 64))  # the padding rows
    k_of = [r["transformer.layers.0.attention.qkv.weight"][16:32] for r in ranks]
    assert torch.equal(k_of[0], k_of[1]) and torch.equal(k_of[2], k_of[3]) and not torch.equal(k_of[1], k_of[2])


def test_trtllm_tp_must_divide_the_heads(tmp_path):
    model = _hf_model(qk_norm=True, tied=False, kv_heads=2)
    with pytest.raises(ValueError, match="tp=3"):
        _export(model, tmp_path, tp=3)


def _recipe(name, *args, ok=True):
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert (r.returncode == 0) == ok, r.stderr[-3000:]
    return r


def test_export_recipe_rejects_bad_format_and_tp(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_recipe", ROOT / "recipes" / "export_checkpoint.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert recipe.main(["checkpoint=x", "output=y", "format=onnx"]) == 2
    assert "format: must be hf or trtllm" in capsys.readouterr().err
    assert recipe.main(["checkpoint=x", "output=y", "tp=2"]) == 2  # tp is for format=trtllm
    assert "tp:" in capsys.readouterr().err


@pytest.mark.slow
def test_export_recipe_writes_a_trtllm_checkpoint(tmp_path):
    from safetensors.torch import load_file

    model = _hf_model(qk_norm=True, tied=False)
    model.save_pretrained(tmp_path / "hf")
    _recipe("import_checkpoint.py", f"hf={tmp_path / 'hf'}", f"output={tmp_path / 'ckpt'}")
    _recipe(
        "export_checkpoint.py",
        f"checkpoint={tmp_path / 'ckpt'}",
        f"output={tmp_path / 'trt'}",
        "format=trtllm",
        "tp=2",
        "dtype=fp32",
    )
    cfg = json.loads((tmp_path / "trt" / "config.json").read_text())
    ranks = [load_file(tmp_path / "trt" / f"rank{r}.safetensors") for r in range(2)]
    ids = [1, 2, 3, 4, 5]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double()
    torch.testing.assert_close(trtllm_forward(cfg, ranks, ids), ref, rtol=1e-4, atol=1e-4)
