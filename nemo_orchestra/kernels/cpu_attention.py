"""Attention of one sequence in blocks of queries, for the short sequences a CPU trains on.

PyTorch's CPU flash kernel (``F.scaled_dot_product_attention``) keeps no probabilities, so its
backward recomputes them, and it runs a masked block (a continuation after a shared prompt) over
every key. At the lengths of CPU training (a few hundred tokens, head dim 64) that costs more than it
saves. ``BlockedAttention`` takes 64 queries at a time: their scores in fp32 over the keys they may
see (a causal block stops at its last query's key), softmax in fp32, probabilities in the input dtype
for the value product (as flash attention does on a GPU), kept for the backward, which is then four
products a block. ``nemo_orchestra/kernels/bench.py`` times both paths (docs/performance.md).

The kept probabilities take H x L x S elements, so ``attend`` runs this path only while that stays
small (``DENSE_MAX_SCORES``), and the flash kernel beyond.

Shapes (legend): H heads (key/value heads already repeated to the query heads), L queries, S keys,
D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 64  # queries a block: a block's fp32 scores (4 heads x 64 x 520) stay in a core's L2
DENSE_MAX_SCORES = 1 << 24  # H * L * S above this runs the flash kernel (probabilities not kept)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blocks(pos: list[int] | None, L: int, S: int):
    """(first query, end query, first key a query of the block may not see, keys visible to the
    block) per block of BLOCK queries; ``pos`` sorted, so keys before the block's first position are
    visible to all of its queries and only the columns from there to its last position need a mask."""
    for i0 in range(0, L, BLOCK):
        i1 = min(L, i0 + BLOCK)
        if pos is None:
            yield i0, i1, S, S
        else:
            yield i0, i1, pos[i0] + 1, pos[i1 - 1] + 1


class BlockedAttention(torch.autograd.Function):
    """softmax(scale * q k^T, masked) v for one sequence: q_HLD, k_HSD, v_HSD in one dtype; query i
    sees keys j <= pos_L[i] (``pos_L`` ascending: the key index of each query's own token), every key
    when ``pos_L`` is None. Returns o_HLD in q's dtype."""

    @staticmethod
    def forward(ctx, q_HLD, k_HSD, v_HSD, pos_L, scale):
        acc = _accumulate_dtype(q_HLD.dtype)
        L, S = q_HLD.shape[1], k_HSD.shape[1]
        pos = None if pos_L is None else pos_L.tolist()
        # contiguous once (a pack's per-sequence views are strided): each product then reads its rows in place
        q_HLD, k_HSD, v_HSD = q_HLD.contiguous(), k_HSD.contiguous(), v_HSD.contiguous()
        qa_HLD, kta_HDS = q_HLD.to(acc) * scale, k_HSD.to(acc).transpose(1, 2)
        keys = None if pos_L is None else torch.arange(S, device=q_HLD.device)
        outs, probs = [], []
        for i0, i1, m, e in _blocks(pos, L, S):
            s_HBE = torch.bmm(qa_HLD[:, i0:i1], kta_HDS[:, :, :e])
            if m < e:  # keys m..e-1: each query's own and earlier ones stay
                s_HBE[:, :, m:e].masked_fill_(keys[None, m:e] > pos_L[i0:i1, None], float("-inf"))
            p_HBE = torch.softmax(s_HBE, dim=-1).to(q_HLD.dtype)
            outs.append(torch.bmm(p_HBE, v_HSD[:, :e]))
            probs.append(p_HBE)
        o_HLD = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        ctx.save_for_backward(q_HLD, k_HSD, v_HSD, o_HLD, *probs)
        ctx.pos, ctx.scale = pos, scale
        return o_HLD

    @staticmethod
    def backward(ctx, do_HLD):
        q_HLD, k_HSD, v_HSD, o_HLD, *probs = ctx.saved_tensors
        acc = _accumulate_dtype(q_HLD.dtype)
        L, S = q_HLD.shape[1], k_HSD.shape[1]
        do_HLD = do_HLD.contiguous()
        # softmax backward: ds = p * (dp - rowsum(dp * p)), and rowsum(dp * p) = rowsum(do * o); the
        # scale of the scores multiplies dq and dk once at the end
        delta_HL1 = (do_HLD.to(acc) * o_HLD.to(acc)).sum(-1, keepdim=True)
        vt_HDS = v_HSD.transpose(1, 2)
        dk_HSD = torch.zeros(k_HSD.shape, dtype=acc, device=k_HSD.device)
        dv_HSD = torch.zeros(v_HSD.shape, dtype=acc, device=v_HSD.device)
        dqs = []
        for (i0, i1, _, e), p_HBE in zip(_blocks(ctx.pos, L, S), probs):
            do_HBD = do_HLD[:, i0:i1]
            dv_HSD[:, :e] += torch.bmm(p_HBE.transpose(1, 2), do_HBD)
            dp_HBE = torch.bmm(do_HBD, vt_HDS[:, :, :e]).to(acc)
            ds_HBE = dp_HBE.sub_(delta_HL1[:, i0:i1]).mul_(p_HBE).to(q_HLD.dtype)
            dqs.append(torch.bmm(ds_HBE, k_HSD[:, :e]))
            dk_HSD[:, :e] += torch.bmm(ds_HBE.transpose(1, 2), q_HLD[:, i0:i1])
        dq_HLD = (dqs[0] if len(dqs) == 1 else torch.cat(dqs, dim=1)).mul_(ctx.scale)
        return dq_HLD, dk_HSD.mul_(ctx.scale).to(k_HSD.dtype), dv_HSD.to(v_HSD.dtype), None, None


def attend(q_HLD, k_HSD, v_HSD, *, offset: int | None, scale: float, rows_N: torch.Tensor | None = None):
    """Attention of one sequence's L queries over its S keys: query i sees keys j <= offset + i
    (``offset`` = S - L: causal, with S - L keys in front of the sequence's own, such as a shared
    prompt), or every key when ``offset`` is None. With ``rows_N`` (ascending query indices) only
    those queries are computed: returns [H, N, D] (the gradient of the others' q is 0).
    ``BlockedAttention`` on CPU while the kept probabilities stay small, else SDPA (the flash kernel on
    CPU). Differentiable."""
    H, L, _ = q_HLD.shape
    S = k_HSD.shape[1]
    if offset is not None and offset != S - L:
        raise ValueError(f"offset must be the keys in front of the queries (S - L = {S - L}) or None, got {offset}")
    if rows_N is not None:
        q_HLD = q_HLD.index_select(1, rows_N)
    pos_L = None
    if offset is not None:
        pos_L = (torch.arange(L, device=q_HLD.device) if rows_N is None else rows_N.to(q_HLD.device)) + offset
    L = q_HLD.shape[1]
    if L == 0:
        return q_HLD.clone()
    if q_HLD.device.type == "cpu" and H * L * S <= DENSE_MAX_SCORES:
        return BlockedAttention.apply(q_HLD, k_HSD, v_HSD, pos_L, scale)
    # a batch dimension of 1: 3-D inputs fall back to SDPA's math path, far slower on CPU than its flash kernel
    q, k, v = q_HLD[None], k_HSD[None], v_HSD[None]
    if pos_L is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)[0]
    if L == S and rows_N is None:  # offset 0
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0]
    visible_LS = torch.arange(S, device=q_HLD.device)[None] <= pos_L[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible_LS, scale=scale)[0]
