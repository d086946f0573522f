"""Core attention over packed (THD) sequences, plugged into Megatron's layer spec.

Megatron's local ``DotProductAttention`` refuses ``qkv_format="thd"``; this module takes its
place. Shapes (legend): T total tokens in the pack, Hq query heads, Hkv key/value heads
(per tensor-parallel rank), D head dim, B sequences in the pack.

- ``torch``: ``nemo_orchestra.kernels.reference.varlen_attention_ref`` (SDPA per sequence; the CPU path).
- ``triton``: ``nemo_orchestra.kernels.varlen_attention`` (flash-attention-style Triton kernel; CUDA).
- ``te``: TransformerEngine's ``TEDotProductAttention`` is selected in the layer spec instead.

A pack with shared prompts (``SharedPromptParams.prefix_B``, ``perf.share_prompts``) runs
``nemo_orchestra.kernels.reference.prefix_attention_ref`` on either of our backends: a continuation attends to its
prompt's keys and to its own, causally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

from nemo_orchestra.config import ATTENTION_BACKENDS


def resolve_attention_backend(name: str) -> str:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"model.attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if torch.cuda.is_available() else "torch"
    return name


@dataclass
class SharedPromptParams(PackedSeqParams):
    """Megatron's THD parameters and, per sequence, the index of the shared prompt it continues
    (``PackedBatch.prefix_B``; None: no sequence continues another)."""

    prefix_B: list[int] | None = None


class PackedCoreAttention(MegatronModule):
    """Causal varlen attention: q_THD, k_THD, v_THD + cu_seqlens -> out_T(HqD)."""

    backend: str = "torch"  # set per model class by ``make_core_attention``
    rows_N: torch.Tensor | None = None  # set by ``forward.last_layer_at``: only these queries of a THD pack

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        assert config.context_parallel_size == 1, "context parallelism needs the TE backend"
        self.softmax_scale = softmax_scale

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        assert attention_bias is None, "attention bias is not supported"
        if packed_seq_params is None:  # [S, B, H, D]: run each batch row as one sequence
            if self.rows_N is not None:
                raise ValueError("rows_N selects positions of a THD pack; this input is [S, B, H, D]")
            s, b = query.shape[:2]
            q_TND, k_TND, v_TND = (x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value))
            cu_seqlens = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)
            out_TND = self._attend(q_TND, k_TND, v_TND, cu_seqlens, s)
            return out_TND.reshape(b, s, -1).transpose(0, 1).contiguous()
        assert packed_seq_params.qkv_format == "thd"
        prefix_B = getattr(packed_seq_params, "prefix_B", None)
        if prefix_B is not None:
            from nemo_orchestra.kernels.reference import prefix_attention_ref

            out_TND = prefix_attention_ref(
                query,
                key,
                value,
                packed_seq_params.cu_seqlens_q,
                prefix_B,
                softmax_scale=self.softmax_scale,
                rows_N=self.rows_N,
            )
            return out_TND.flatten(1)
        out_TND = self._attend(query, key, value, packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q)
        return out_TND.flatten(1)

    def _attend(self, q_TND, k_TND, v_TND, cu_seqlens, max_seqlen):
        """Every query's output, or those of ``rows_N`` (the Triton kernel computes all of them)."""
        if self.backend == "triton":
            from nemo_orchestra import kernels

            out, _ = kernels.varlen_attention(
                q_TND, k_TND, v_TND, cu_seqlens, int(max_seqlen), causal=True, softmax_scale=self.softmax_scale
            )
            return out if self.rows_N is None else out.index_select(0, self.rows_N)
        from nemo_orchestra.kernels.reference import varlen_attention_ref

        out, _ = varlen_attention_ref(
            q_TND,
            k_TND,
            v_TND,
            cu_seqlens,
            int(max_seqlen),
            causal=True,
            softmax_scale=self.softmax_scale,
            return_lse=False,
            rows_N=self.rows_N,
        )
        return out


def make_core_attention(backend: str) -> type:
    backend = resolve_attention_backend(backend)
    if backend == "te":
        try:
            from megatron.core.extensions.transformer_engine import TEDotProductAttention
        except ImportError as e:  # pragma: no cover - needs TransformerEngine
            raise ImportError(
                "model.attention_backend=te needs the 'transformer-engine' package "
                "(pip install 'nemo-orchestra[gpu]' on a CUDA machine)"
            ) from e
        return TEDotProductAttention
    return type(f"PackedCoreAttention_{backend}", (PackedCoreAttention,), {"backend": backend})
