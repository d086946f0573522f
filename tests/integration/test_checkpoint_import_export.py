"""HF interop: import a tiny random Qwen3 (and Llama) folder, start a policy from it, export it back.

export(import(x)) must equal x tensor by tensor, load in ``transformers`` and give its logits.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.megatron.parallel import init_distributed

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)


def _hf_folder(path, arch: str, tied: bool, seed: int = 0):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer

    config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    config = config_cls(tie_word_embeddings=tied, **SMALL)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms start at 1: perturb them so their mapping is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    build_embedded_tokenizer(["what is 2 + 2? <tool_call> 4 </tool_call>"] * 8, vocab_size=300).save_pretrained(path)
    return model


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _recipe(name, *args):
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def dist_init():
    init_distributed(load_config([]).parallel, seed=1)


@pytest.mark.slow
def test_recipes_round_trip_a_qwen3_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    original = _hf_folder(tmp_path / "hf", "qwen3", tied=False)
    _recipe("import_checkpoint.py", f"hf={tmp_path / 'hf'}", f"output={tmp_path / 'ckpt'}")
    meta = json.loads((tmp_path / "ckpt" / "nemo_orchestra.json").read_text())
    assert meta["vocab_size"] == VOCAB and meta["model"]["qk_norm"] is True and meta["model"]["num_layers"] == 2
    _recipe("export_checkpoint.py", f"checkpoint={tmp_path / 'ckpt'}", f"output={tmp_path / 'out'}")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "out" / name).is_file(), name
    a, b = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    ids = torch.randint(0, VOCAB, (1, 17))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, original(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_llama_import_has_no_qk_norm_and_round_trips(dist_init, tmp_path, tied):
    from nemo_orchestra.export.convert import export_checkpoint, import_hf

    _hf_folder(tmp_path / "hf", "llama", tied=tied)
    cfg = load_config([])
    model = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), cfg.model, cfg.parallel, torch.device("cpu"))
    assert model.qk_norm is False and model.tie_embeddings is tied
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"), cfg.parallel, torch.device("cpu"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    a, b = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_policy_starts_from_an_hf_folder_or_its_import_with_transformers_logits(dist_init, tmp_path, arch):
    from nemo_orchestra.export.convert import import_hf
    from nemo_orchestra.megatron.forward import forward_logprobs
    from nemo_orchestra.train.packing import pack
    from nemo_orchestra.train.learner import build_learner
    from tests.helpers import traj

    hf = _hf_folder(tmp_path / "hf", arch, tied=False, seed=4)
    cfg = load_config([])
    model = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), cfg.model, cfg.parallel, torch.device("cpu"))
    arch_overrides = [
        f"model.{k}={getattr(model, k)}"
        for k in (
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "ffn_hidden_size",
            "rope_theta",
            "norm_eps",
            "tie_embeddings",
            "qk_norm",
            "max_position_embeddings",
        )
    ]
    ids = torch.randint(0, VOCAB, (29,)).tolist()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    want = want.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    for source in ("hf", "ckpt"):
        run_cfg = load_config([*arch_overrides, f"model.init_from={tmp_path / source}"])
        policy = build_learner(run_cfg, VOCAB, torch.device("cpu"))
        got = forward_logprobs(policy.model, pack([traj(ids=ids)], 64)[0], torch.device("cpu"))
        torch.testing.assert_close(got[:-1], want, atol=2e-5, rtol=1e-5)


def test_init_from_a_different_architecture_names_the_keys(dist_init, tmp_path):
    from nemo_orchestra.train.learner import build_learner

    _hf_folder(tmp_path / "hf", "qwen3", tied=False)
    cfg = load_config([f"model.init_from={tmp_path / 'hf'}"])  # the tiny default: hidden 128, not 64
    with pytest.raises(ValueError, match="model.hidden_size=128"):
        build_learner(cfg, VOCAB, torch.device("cpu"))


def test_export_shards_with_an_index_that_transformers_loads(dist_init, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from nemo_orchestra.export import hf_folder as export
    from nemo_orchestra.export.convert import import_hf

    hf = _hf_folder(tmp_path / "hf", "qwen3", tied=True)
    cfg = load_config([])
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), cfg.model, cfg.parallel, torch.device("cpu"))
    monkeypatch.setattr(export, "SHARD_BYTES", 40_000)  # a few tensors per shard
    from nemo_orchestra.export.convert import export_checkpoint

    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"), cfg.parallel, torch.device("cpu"))
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    ids = torch.randint(0, VOCAB, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, hf(ids).logits, rtol=0, atol=0)
