"""Rotary embeddings of a packed (THD) batch with their cos and sin computed once per forward pass.

Megatron-Core's unfused THD path (``rope_utils._apply_rotary_pos_emb_thd``) rebuilds the packed
frequencies for every call, one slice per sequence of the pack (a ``.item()`` each), and takes their
cos and sin again: for the query and for the key of every layer, in the update and in the reference
pass. Here the cos and sin of a pass's frequencies (the same tensor for every layer: ``GPTModel``
computes it once a forward) are kept for the next calls, and the rotation is the same expression on
the same operands, so the result is Megatron's to the bit (``tests/unit/test_rope.py``). The packed
rows and their cos and sin are the same for every call of a pass, so they are computed once a pass,
not for the query and the key of every layer (docs/performance.md).

``install`` puts ``apply_rotary_pos_emb`` where Megatron's attention looks it up. Every other case
(fused RoPE, context parallelism, interleaved or MLA rotation, no ``cu_seqlens``, frequencies with a
gradient) goes to Megatron's own function.
"""

from __future__ import annotations

import threading
import weakref

import torch

_KEEP = 2  # passes whose cos/sin stay: the update's and the reference's, which run at the same time
_cache: dict[tuple, tuple] = {}
_lock = threading.Lock()


def _megatron():
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.apply_rotary_pos_emb


def _rows(freqs: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The frequency row of each token of the pack, as Megatron's THD path picks it: the pack's own
    rows when there is one per token, else each sequence's from position 0."""
    total = int(cu_seqlens[-1])
    if freqs.size(0) == total:
        return freqs
    cu = cu_seqlens.to(device=freqs.device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    pos = torch.arange(total, device=freqs.device) - torch.repeat_interleave(cu[:-1], lens)
    return freqs.index_select(0, pos)


def _cos_sin(freqs, cu_seqlens, dtype, mscale):
    key = (id(freqs), id(cu_seqlens), dtype, mscale)
    with _lock:
        hit = _cache.get(key)
    if hit is not None and hit[0]() is freqs and hit[1]() is cu_seqlens:
        return hit[2], hit[3]
    rows = _rows(freqs, cu_seqlens)
    cos, sin = ((f(rows) * mscale).to(dtype).squeeze(1) for f in (torch.cos, torch.sin))
    with _lock:
        _cache[key] = (weakref.ref(freqs), weakref.ref(cu_seqlens), cos, sin)
        while len(_cache) > _KEEP:
            _cache.pop(next(iter(_cache)))
    return cos, sin


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
    """Megatron-Core's ``apply_rotary_pos_emb`` (same arguments, same result)."""
    if (
        cu_seqlens is None
        or config.apply_rope_fusion
        or config.rotary_interleaved
        or config.multi_latent_attention
        or freqs.requires_grad
        or cp_group is None
        or cp_group.size() != 1
    ):
        return _megatron()(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    cos, sin = _cos_sin(freqs, cu_seqlens, t.dtype, mscale)  # [T, 1, rot]
    rot = cos.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    out = (x * cos) + (_rotate_half(x, False) * sin)
    return torch.cat((out, rest), dim=-1)


def install() -> None:
    """Megatron's attention calls this module's ``apply_rotary_pos_emb``. Idempotent."""
    from megatron.core.transformer import attention

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
