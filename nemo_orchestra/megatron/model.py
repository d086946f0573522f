"""The Qwen3 architecture as a Megatron-Core ``GPTModel``.

Qwen3 = pre-norm decoder with RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, RMSNorm on
queries and keys per head (QK-norm), no biases, tied or untied embeddings. Attention runs on
packed THD input through our core attention (see ``attention.py``). ``model.qk_norm=false``
builds the same decoder without QK-norm: the Llama architecture.

FP8 (``model.fp8``) uses TransformerEngine's layer spec and its FP8 autocast, with delayed
(amax history) or tensorwise current scaling (``model.fp8_recipe``); weights stay bf16 and the
optimizer keeps fp32 master copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_orchestra.config import PARAMS_DTYPES, ModelConfig, ParallelConfig
from nemo_orchestra.megatron.attention import (
    make_core_attention,
    resolve_attention_backend,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(DTYPES) == PARAMS_DTYPES, "config.PARAMS_DTYPES must name the dtypes mapped here"


def transformer_config(model: ModelConfig, parallel: ParallelConfig, initialize: bool = True):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if parallel.sequence_parallel and not torch.cuda.is_available():
        raise ValueError("parallel.sequence_parallel needs the TransformerEngine or Apex norm (GPU only)")
    dtype = DTYPES[model.params_dtype]
    fp8 = {}
    if model.fp8 is not None:
        _require_te("model.fp8")
        fp8 = dict(fp8=model.fp8, fp8_recipe=model.fp8_recipe)
        if model.fp8_recipe == "delayed":
            fp8.update(fp8_margin=0, fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        qk_layernorm=model.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=initialize,  # False when weights are loaded right after (import, export)
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,  # DDP sums gradients; the loss divides by the global token count
        cuda_graph_scope=[],  # Megatron's default "full" means this and warns that it is deprecated
        **(
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
            if parallel.activation_recompute
            else {}
        ),
        **fp8,
    )


def layer_spec(model: ModelConfig):
    """Megatron's local layer spec with our packed core attention (or TE's full spec)."""
    backend = resolve_attention_backend(model.attention_backend)
    if model.fp8 is not None or backend == "te":
        _require_te("model.attention_backend=te" if backend == "te" else "model.fp8")
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_norm)
        if backend != "te":
            spec.submodules.self_attention.submodules.core_attention = make_core_attention(backend)
        return spec
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=model.qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = make_core_attention(backend)
    return spec


def build_gpt_model(
    model: ModelConfig, parallel: ParallelConfig, vocab_size: int, device: torch.device, initialize: bool = True
):
    """One pipeline stage of the policy (pre/post-process flags from the PP rank)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from nemo_orchestra.megatron import rope
    from nemo_orchestra.megatron.cpu_compat import cuda_tensors_stay

    rope.install()  # the packs' RoPE with its cos and sin once a forward pass
    config = transformer_config(model, parallel, initialize)
    with cuda_tensors_stay():  # tied embeddings under PP call .cuda() on the output layer
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(model),
            vocab_size=vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=model.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(model.rope_theta),
            rotary_percent=1.0,
        )
    if config.params_dtype != torch.float32:  # Megatron's torch norms are built fp32: one dtype, the fused kernel
        for m in gpt.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.to(config.params_dtype)
    return gpt.to(device)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron shards the vocabulary over TP ranks: pad to a multiple of lcm(``multiple``, tp).

    With the default 128 the size does not depend on TP (for TP up to 128), so a checkpoint
    resumes under another tensor-parallel size.
    """
    import math

    m = math.lcm(multiple, tp)
    return ((vocab_size + m - 1) // m) * m


def _require_te(what: str) -> None:
    try:
        import transformer_engine  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"{what} needs the 'transformer-engine' package, which is not installed "
            "(CUDA machines: pip install 'nemo-orchestra[gpu]')"
        ) from e


ARCH_KEYS = (
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "ffn_hidden_size",
    "tie_embeddings",
    "qk_norm",
    "rope_theta",
    "norm_eps",
)


def check_vocab(
    found: int, ours: int, where: str, source_tokenizer: str | None = None, same_tokenizer: bool = False
) -> None:
    """The checkpoint's vocabulary size against the model's. Two sizes mean two tokenizers unless
    ``same_tokenizer`` (then only the padding differs): a token id names another token in each, so
    the fix is the checkpoint's tokenizer (``source_tokenizer``, its folder when known), not its size."""
    if found == ours:
        return
    head = f"model.init_from={where}: the checkpoint's vocabulary has {found} entries, the model {ours}"
    if same_tokenizer:
        raise ValueError(f"{head}; the tokenizer is the same, padded to another size: set model.vocab_size={found}")
    tokenizer = source_tokenizer or "<the tokenizer it was trained with>"
    raise ValueError(
        f"{head}: the checkpoint was trained with another tokenizer: set model.tokenizer={tokenizer} so that "
        "token ids mean the same (a different model.vocab_size would load embeddings of other tokens)"
    )


def architecture_differences(found, model_cfg) -> list[str]:
    """``model.KEY=ours (checkpoint: theirs)`` for each ``ARCH_KEYS`` entry that differs; ``found``: a
    ModelConfig or a checkpoint's recorded model dict."""
    get = found.get if isinstance(found, dict) else (lambda k: getattr(found, k))
    return [
        f"model.{k}={getattr(model_cfg, k)} (checkpoint: {get(k)})"
        for k in ARCH_KEYS
        if get(k) != getattr(model_cfg, k)
    ]


def check_same_architecture(found, model_cfg, where: str) -> None:
    diff = architecture_differences(found, model_cfg)
    if diff:
        raise ValueError(f"model.init_from={where}: the checkpoint's architecture differs: " + ", ".join(diff))
