"""Write a TensorRT-LLM checkpoint for Qwen3 (or Llama): ``config.json`` and ``rank{i}.safetensors``.

This is the folder ``trtllm-build --checkpoint_dir DIR`` reads, laid out as TensorRT-LLM's own
converter writes it for Qwen3 (``tensorrt_llm/models/qwen/convert.py``, ``convert_hf_qwen``; the
config fields of ``models/qwen/config.py`` and ``modeling_utils.PretrainedConfig``). One file per
tensor-parallel rank (pipeline parallelism 1), the weights of rank r:

    transformer.vocab_embedding.weight             [V, H]            full (no parallel embedding)
    transformer.layers.{l}.input_layernorm.weight  [H]
    transformer.layers.{l}.attention.qkv.weight    [(Hq + 2 Hkv) D / tp, H]
                                                   = cat(q_r, k_r, v_r): rank r's query heads, then its
                                                     KV heads (repeated when Hkv < tp), then its values
    transformer.layers.{l}.attention.q_layernorm.weight, .k_layernorm.weight   [D]   (Qwen3 only)
    transformer.layers.{l}.attention.dense.weight  [H, Hq D / tp]    o_proj, columns split
    transformer.layers.{l}.post_layernorm.weight   [H]
    transformer.layers.{l}.mlp.fc.weight           [F / tp, H]       gate_proj (the activated branch)
    transformer.layers.{l}.mlp.gate.weight         [F / tp, H]       up_proj
    transformer.layers.{l}.mlp.proj.weight         [H, F / tp]       down_proj, columns split
    transformer.ln_f.weight                        [H]
    lm_head.weight                                 [V' / tp, H]      V padded to a multiple of tp with
                                                                     zero rows (tied: the embedding)

Column-parallel weights (qkv, fc, gate, lm_head) are split by rows, row-parallel ones (dense,
proj) by columns; a forward sums the row-parallel outputs over ranks (``tests/integration/test_trtllm.py``
runs exactly that forward and compares it with ``transformers``).
"""

from __future__ import annotations

import json
import os

import torch

from nemo_orchestra.config import ModelConfig

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_tp(model: ModelConfig, tp: int) -> None:
    """ValueError naming ``tp`` when the model's heads or FFN cannot be split ``tp`` ways."""
    kv = model.num_query_groups
    problems = [
        f"{what} ({n})"
        for what, n in (("query heads", model.num_attention_heads), ("FFN width", model.ffn_hidden_size))
        if n % tp
    ]
    if kv % tp and tp % kv:
        problems.append(f"KV heads ({kv}; tp must divide them or be a multiple of them)")
    if tp < 1 or problems:
        raise ValueError(f"tp={tp}: must be >= 1 and divide the model's " + ", ".join(problems or ["sizes"]))


def trtllm_config(model: ModelConfig, vocab_size: int, tp: int, dtype: torch.dtype) -> dict:
    """TensorRT-LLM's ``config.json`` for this model sharded ``tp`` ways (pp=1, no quantization)."""
    config = {
        "architecture": "Qwen3ForCausalLM" if model.qk_norm else "LlamaForCausalLM",
        "dtype": DTYPE_NAMES[dtype],
        "logits_dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_size": model.head_dim,
        "intermediate_size": model.ffn_hidden_size,
        "hidden_act": "silu",
        "norm_epsilon": model.norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": model.rope_theta,
        "rotary_scaling": None,
        "max_position_embeddings": model.max_position_embeddings,
        "attn_bias": False,
        "mlp_bias": False,
        "qk_layernorm": model.qk_norm,
        "tie_word_embeddings": model.tie_embeddings,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1, "cp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    if model.qk_norm:
        config["qwen_type"] = "qwen3"  # TensorRT-LLM's Qwen family picks its Qwen3 layers by this
    return config


def _rows(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=0)[rank]


def _cols(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=1)[rank]


def _kv_rows(t: torch.Tensor, kv_heads: int, head_dim: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s KV heads; with fewer heads than ranks each head is repeated tp / kv_heads times."""
    if kv_heads < tp:
        t = t.view(kv_heads, 1, head_dim, -1).expand(kv_heads, tp // kv_heads, head_dim, -1)
        t = t.reshape(tp * head_dim, -1)
    return _rows(t, tp, rank)


def rank_weights(
    hf: dict[str, torch.Tensor], model: ModelConfig, vocab_size: int, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s TensorRT-LLM weights from Hugging Face-named Qwen3 (or Llama) weights."""
    kv, d = model.num_query_groups, model.head_dim
    embed = hf["model.embed_tokens.weight"]
    out = {"transformer.vocab_embedding.weight": embed, "transformer.ln_f.weight": hf["model.norm.weight"]}
    head = embed if model.tie_embeddings else hf["lm_head.weight"]
    padded = -(-vocab_size // tp) * tp
    if padded != vocab_size:
        head = torch.cat([head, head.new_zeros(padded - vocab_size, head.shape[1])])
    out["lm_head.weight"] = _rows(head, tp, rank)
    for i in range(model.num_layers):
        h, t = f"model.layers.{i}.", f"transformer.layers.{i}."
        out[t + "attention.qkv.weight"] = torch.cat(
            [
                _rows(hf[h + "self_attn.q_proj.weight"], tp, rank),
                _kv_rows(hf[h + "self_attn.k_proj.weight"], kv, d, tp, rank),
                _kv_rows(hf[h + "self_attn.v_proj.weight"], kv, d, tp, rank),
            ]
        )
        out[t + "attention.dense.weight"] = _cols(hf[h + "self_attn.o_proj.weight"], tp, rank)
        if model.qk_norm:
            out[t + "attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
            out[t + "attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        out[t + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[t + "post_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[t + "mlp.fc.weight"] = _rows(hf[h + "mlp.gate_proj.weight"], tp, rank)
        out[t + "mlp.gate.weight"] = _rows(hf[h + "mlp.up_proj.weight"], tp, rank)
        out[t + "mlp.proj.weight"] = _cols(hf[h + "mlp.down_proj.weight"], tp, rank)
    return out


def export_trtllm(
    megatron_state: dict[str, torch.Tensor],
    model: ModelConfig,
    vocab_size: int,
    out_dir: str,
    tp: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    """Write ``config.json`` and ``rank{0..tp-1}.safetensors`` into ``out_dir`` from full Megatron weights."""
    from safetensors.torch import save_file

    from nemo_orchestra.export.qwen3 import megatron_to_hf

    check_tp(model, tp)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype: TensorRT-LLM export takes {sorted(DTYPE_NAMES.values())}, got {dtype}")
    hf = megatron_to_hf(megatron_state, model)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(trtllm_config(model, vocab_size, tp, dtype), f, indent=2)
    for rank in range(tp):
        weights = {k: v.to(dtype).contiguous().cpu() for k, v in rank_weights(hf, model, vocab_size, tp, rank).items()}
        save_file(weights, os.path.join(out_dir, f"rank{rank}.safetensors"), metadata={"format": "pt"})
    return out_dir
