"""Megatron-Core GPTModel <-> Hugging Face Qwen3 weights.

Megatron fuses q, k and v into ``linear_qkv`` with rows grouped per KV group:
for each of the G groups, its Hq/G query heads, then its key head, then its value head
(each D rows). The MLP fuses gate and up into ``linear_fc1`` as [gate; up].
"""

from __future__ import annotations

import torch

from nemo_orchestra.config import ModelConfig


def hf_config(model: ModelConfig, vocab_size: int, tokenizer=None, dtype: str = "float32"):
    from transformers import Qwen3Config

    special = {}
    if tokenizer is not None:
        special = dict(
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        )
    return Qwen3Config(
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


def megatron_to_hf(sd: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Full (TP=1, PP=1) Megatron state dict -> HF Qwen3 state dict."""
    g, d = model.num_query_groups, model.head_dim
    qpg = model.num_attention_heads // g
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    if not model.tie_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for i in range(model.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = sd[m + "self_attention.linear_qkv.weight"].view(g, qpg + 2, d, -1)
        out[h + "self_attn.q_proj.weight"] = qkv[:, :qpg].reshape(g * qpg * d, -1)
        out[h + "self_attn.k_proj.weight"] = qkv[:, qpg].reshape(g * d, -1)
        out[h + "self_attn.v_proj.weight"] = qkv[:, qpg + 1].reshape(g * d, -1)
        out[h + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"]
        out[h + "self_attn.q_norm.weight"] = sd[m + "self_attention.q_layernorm.weight"]
        out[h + "self_attn.k_norm.weight"] = sd[m + "self_attention.k_layernorm.weight"]
        gate, up = sd[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"] = gate
        out[h + "mlp.up_proj.weight"] = up
        out[h + "mlp.down_proj.weight"] = sd[m + "mlp.linear_fc2.weight"]
        out[h + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron(hf: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Qwen3 (or Llama without QK-norm weights) state dict -> full Megatron state dict."""
    g, d = model.num_query_groups, model.head_dim
    qpg = model.num_attention_heads // g
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not model.tie_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(model.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        q = hf[h + "self_attn.q_proj.weight"].view(g, qpg, d, -1)
        k = hf[h + "self_attn.k_proj.weight"].view(g, 1, d, -1)
        v = hf[h + "self_attn.v_proj.weight"].view(g, 1, d, -1)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(g * (qpg + 2) * d, -1)
        out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def full_state_dict(gpt) -> dict[str, torch.Tensor]:
    """The model's weights under Megatron names, without extra state (TP=1, PP=1 only)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() > 1 or parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("gathering weights from tensor/pipeline-parallel shards is not supported yet: "
                         "export from a tp=1, pp=1 run")
    return {k: v.detach() for k, v in gpt.state_dict().items() if "_extra_state" not in k}
