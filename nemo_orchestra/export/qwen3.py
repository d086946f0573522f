"""Megatron-Core GPTModel <-> Hugging Face Qwen3 (and Llama) weights and configs.

Megatron fuses q, k and v into ``linear_qkv`` with rows grouped per KV group:
for each of the G groups, its Hq/G query heads, then its key head, then its value head
(each D rows). The MLP fuses gate and up into ``linear_fc1`` as [gate; up].
Llama is Qwen3 without the per-head RMSNorm on queries and keys (``model.qk_norm=false``).

The mapping works one tensor at a time (``hf_to_megatron_tensor``) so that a rank loading an
8B checkpoint reads only the tensors of its pipeline stage, one layer at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import torch

from nemo_orchestra.config import ModelConfig

ARCHITECTURES = {"Qwen3ForCausalLM": True, "LlamaForCausalLM": False}  # -> has QK-norm


def hf_config(model: ModelConfig, vocab_size: int, tokenizer=None, dtype: str = "float32"):
    from transformers import LlamaConfig, Qwen3Config

    special = {}
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        special = dict(
            bos_token_id=None,
            eos_token_id=vocab["<|im_end|>"] if "<|im_end|>" in vocab else tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups,
        head_dim=model.head_dim,
        hidden_act="silu",
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.norm_eps,
        rope_theta=model.rope_theta,
        tie_word_embeddings=model.tie_embeddings,
        attention_bias=False,
        torch_dtype=dtype,
        **special,
    )
    if model.qk_norm:
        return Qwen3Config(**common)
    return LlamaConfig(mlp_bias=False, **common)


def architecture(model: ModelConfig) -> str:
    return "Qwen3ForCausalLM" if model.qk_norm else "LlamaForCausalLM"


def model_config_from_hf(hf: dict, base: ModelConfig) -> ModelConfig:
    """``base`` with the architecture fields of a Hugging Face ``config.json`` (Qwen3 or Llama)."""
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}: import supports {sorted(ARCHITECTURES)}")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"rope scaling {rope_type!r} is not supported (only plain RoPE)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention_bias/mlp_bias checkpoints are not supported")
    heads = hf["num_attention_heads"]
    return dataclasses.replace(
        base,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=hf["rms_norm_eps"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf["max_position_embeddings"],
        qk_norm=ARCHITECTURES[arch],
    )


def megatron_names(model: ModelConfig) -> list[str]:
    """Every weight of the full (TP=1, PP=1) model under Megatron local-spec names."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    if not model.tie_embeddings:
        names.append("output_layer.weight")
    per_layer = [
        "input_layernorm.weight",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight",
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
    ]
    if model.qk_norm:
        per_layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    return names + [f"decoder.layers.{i}.{p}" for i in range(model.num_layers) for p in per_layer]


_DIRECT = {  # Megatron suffix -> HF suffix, within a layer
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def hf_to_megatron_tensor(name: str, hf_get: Callable[[str], torch.Tensor], model: ModelConfig) -> torch.Tensor:
    """One full Megatron weight from the HF tensors it is made of (``hf_get(hf_name)``)."""
    if name in _TOP:
        return hf_get(_TOP[name])
    _, _, i, suffix = name.split(".", 3)
    h = f"model.layers.{i}."
    if suffix in _DIRECT:
        return hf_get(h + _DIRECT[suffix])
    if suffix == "self_attention.linear_qkv.weight":
        g, d = model.num_query_groups, model.head_dim
        qpg = model.num_attention_heads // g
        q = hf_get(h + "self_attn.q_proj.weight").view(g, qpg, d, -1)
        k = hf_get(h + "self_attn.k_proj.weight").view(g, 1, d, -1)
        v = hf_get(h + "self_attn.v_proj.weight").view(g, 1, d, -1)
        return torch.cat([q, k, v], dim=1).reshape(g * (qpg + 2) * d, -1)
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([hf_get(h + "mlp.gate_proj.weight"), hf_get(h + "mlp.up_proj.weight")])
    raise KeyError(name)


def hf_to_megatron(hf: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Qwen3 (or Llama) state dict -> full Megatron state dict."""
    return {n: hf_to_megatron_tensor(n, hf.__getitem__, model).contiguous() for n in megatron_names(model)}


def megatron_to_hf(sd: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Full (TP=1, PP=1) Megatron state dict -> HF Qwen3 (or Llama) state dict."""
    g, d = model.num_query_groups, model.head_dim
    qpg = model.num_attention_heads // g
    out = {hf: sd[m] for m, hf in _TOP.items() if not (m == "output_layer.weight" and model.tie_embeddings)}
    for i in range(model.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for suffix, hf_suffix in _DIRECT.items():
            if m + suffix in sd:
                out[h + hf_suffix] = sd[m + suffix]
        qkv = sd[m + "self_attention.linear_qkv.weight"].view(g, qpg + 2, d, -1)
        out[h + "self_attn.q_proj.weight"] = qkv[:, :qpg].reshape(g * qpg * d, -1)
        out[h + "self_attn.k_proj.weight"] = qkv[:, qpg].reshape(g * d, -1)
        out[h + "self_attn.v_proj.weight"] = qkv[:, qpg + 1].reshape(g * d, -1)
        gate, up = sd[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"] = gate
        out[h + "mlp.up_proj.weight"] = up
    return {k: v.contiguous() for k, v in out.items()}


def full_state_dict(gpt) -> dict[str, torch.Tensor]:
    """The model's full weights under Megatron names, gathered from its TP/PP shards.

    Collective over the model-parallel group; every rank of it gets the full dict.
    """
    from nemo_orchestra.megatron.sharding import gather_full_state

    return gather_full_state(gpt)


class HFWeights:
    """Lazy reader of a Hugging Face folder's safetensors: ``weights[name]`` loads one tensor."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(folder, "model.safetensors")):
            with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
                files = {k: "model.safetensors" for k in f.keys()}
        else:
            raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json")
        self.folder, self.files, self._open = folder, files, {}

    def keys(self):
        return self.files.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"{self.folder}: no tensor {name!r}")
        fname = self.files[name]
        if fname not in self._open:
            self._open[fname] = safe_open(os.path.join(self.folder, fname), "pt")
        return self._open[fname].get_tensor(name)


def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder}: not a Hugging Face model folder (no config.json)")
    with open(path) as f:
        return json.load(f)
