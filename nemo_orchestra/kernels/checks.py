"""Input validation shared by the kernels and their references.

A user's mistake is a ``ValueError`` that says what is wrong; the kernels trust what passes here.
Shapes (legend): T total tokens, Hq query heads, Hkv key/value heads, D head dim, B sequences,
N rewards, G groups.
"""

from __future__ import annotations

import torch

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ADVANTAGE_MODES = ("mean", "std", "loo")


def check_varlen_inputs(q_THD, k_THD, v_THD, cu_seqlens_B1, max_seqlen) -> list[int]:
    """Validate packed attention inputs and return ``cu_seqlens`` as a list (one small host sync)."""
    for name, x in (("q", q_THD), ("k", k_THD), ("v", v_THD)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must be [T, H, D], got shape {tuple(x.shape)}")
        if x.dtype not in ATTENTION_DTYPES:
            raise ValueError(f"{name} must be one of {ATTENTION_DTYPES}, got {x.dtype}")
    if not (q_THD.dtype == k_THD.dtype == v_THD.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q_THD.dtype}, {k_THD.dtype}, {v_THD.dtype}")
    if not (q_THD.device == k_THD.device == v_THD.device):
        raise ValueError(f"q, k, v must be on one device, got {q_THD.device}, {k_THD.device}, {v_THD.device}")
    T, Hq, D = q_THD.shape
    if k_THD.shape != v_THD.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k_THD.shape)} and {tuple(v_THD.shape)}")
    if k_THD.shape[0] != T or k_THD.shape[2] != D:
        raise ValueError(f"k must be [T={T}, Hkv, D={D}] like q, got {tuple(k_THD.shape)}")
    Hkv = k_THD.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a positive multiple of key/value heads ({Hkv})")
    if not isinstance(cu_seqlens_B1, torch.Tensor) or cu_seqlens_B1.dtype != torch.int32:
        got = cu_seqlens_B1.dtype if isinstance(cu_seqlens_B1, torch.Tensor) else type(cu_seqlens_B1).__name__
        raise ValueError(f"cu_seqlens must be an int32 tensor, got {got}")
    if cu_seqlens_B1.dim() != 1 or cu_seqlens_B1.numel() < 1:
        raise ValueError(f"cu_seqlens must be [B+1] with B >= 0, got shape {tuple(cu_seqlens_B1.shape)}")
    if cu_seqlens_B1.device != q_THD.device:
        raise ValueError(f"cu_seqlens must be on {q_THD.device} like q, got {cu_seqlens_B1.device}")
    cu = cu_seqlens_B1.tolist()
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu[0]} .. {cu[-1]}")
    lengths = [e - s for s, e in zip(cu[:-1], cu[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError("cu_seqlens must be non-decreasing")
    if int(max_seqlen) < max(lengths, default=0):
        raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest sequence ({max(lengths)})")
    return cu


def check_advantage_inputs(rewards_N, group_ids_N, offsets_G1, mode, eps, clip) -> None:
    if not isinstance(rewards_N, torch.Tensor) or rewards_N.dim() != 1 or not rewards_N.is_floating_point():
        raise ValueError("rewards must be a 1-D floating-point tensor")
    if (group_ids_N is None) == (offsets_G1 is None):
        raise ValueError("pass exactly one of group_ids (unsorted [N]) or offsets (sorted [G+1])")
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"mode must be one of {ADVANTAGE_MODES}, got {mode!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be None or > 0, got {clip}")
    N = rewards_N.numel()
    name, idx = ("group_ids", group_ids_N) if group_ids_N is not None else ("offsets", offsets_G1)
    if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32 or int64 tensor")
    if idx.device != rewards_N.device:
        raise ValueError(f"{name} must be on {rewards_N.device} like rewards, got {idx.device}")
    if group_ids_N is not None:
        if group_ids_N.numel() != N:
            raise ValueError(f"group_ids must have one id per reward ({N}), got {group_ids_N.numel()}")
        return
    if offsets_G1.numel() < 1:
        raise ValueError("offsets must be [G+1] with G >= 0")
    first, last = offsets_G1[0].item(), offsets_G1[-1].item()
    if first != 0 or last != N:
        raise ValueError(f"offsets must start at 0 and end at N={N}, got {first} .. {last}")
    if offsets_G1.numel() > 1 and bool((offsets_G1[1:] < offsets_G1[:-1]).any()):
        raise ValueError("offsets must be non-decreasing")
