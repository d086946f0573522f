"""PyTorch references of the kernels: the spec of each op, and the path used on CPU.

Shapes (legend): T total tokens in a pack, Hq query heads, Hkv key/value heads, D head dim,
B sequences (``cu_seqlens_B1`` holds B+1 offsets), N rewards, G groups.
"""

from __future__ import annotations

import torch

from nemo_orchestra.kernels.checks import check_advantage_inputs, check_varlen_inputs
from nemo_orchestra.kernels.cpu_attention import attend


def varlen_attention_ref(
    q_THD,
    k_THD,
    v_THD,
    cu_seqlens_B1,
    max_seqlen,
    *,
    causal=True,
    softmax_scale=None,
    return_lse=True,
    rows_N=None,
):
    """Attention over packed sequences, one sequence at a time (``nemo_orchestra.kernels.cpu_attention.attend``).

    q_THD is [T, Hq, D], k_THD and v_THD are [T, Hkv, D] with Hq a multiple of Hkv (query head h
    reads key/value head h // (Hq // Hkv)). Token i of a sequence attends to tokens j <= i of the
    same sequence when ``causal``, to all of them otherwise; scores are scaled by ``softmax_scale``
    (default D**-0.5). Returns ``(out_THD, lse_HT)``: out in q's dtype, and lse_HT[h, i] =
    log(sum_j exp(score_ij)) in fp32 (natural log), or None when ``return_lse`` is False.
    With ``rows_N`` (ascending positions in the pack) only those queries are computed: out_NHD and
    lse_HN, as the whole pack's results at those rows. Differentiable by autograd.
    """
    cu = check_varlen_inputs(q_THD, k_THD, v_THD, cu_seqlens_B1, max_seqlen)
    T, Hq, D = q_THD.shape
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    outs, lses = [], []
    lens, qs, ks, vs = _per_sequence(q_THD, k_THD, v_THD, cu)
    for q_HLD, k_HLD, v_HLD, rows_n in zip(qs, ks, vs, rows_per_sequence(rows_N, cu)):
        if (q_HLD.shape[1] if rows_n is None else rows_n.numel()) == 0:
            continue
        o_HLD = attend(q_HLD, k_HLD, v_HLD, offset=0 if causal else None, scale=scale, rows_N=rows_n)
        outs.append(o_HLD.transpose(0, 1))
        if return_lse:
            lse_HL = _lse(q_HLD, k_HLD, scale, causal)
            lses.append(lse_HL if rows_n is None else lse_HL[:, rows_n])
    if not outs:  # no tokens, or no rows
        lse = torch.empty(Hq, 0, dtype=torch.float32, device=q_THD.device) if return_lse else None
        return (q_THD.clone() if rows_N is None else q_THD.index_select(0, rows_N)), lse
    out_THD = torch.cat(outs, dim=0)
    return out_THD, (torch.cat(lses, dim=1) if return_lse else None)


def prefix_attention_ref(q_THD, k_THD, v_THD, cu_seqlens_B1, prefix_B, *, softmax_scale=None, rows_N=None):
    """Causal attention over packed sequences, where sequence b may continue sequence ``prefix_B[b]``
    (-1: none): its tokens attend to all of that sequence's tokens and causally to their own, as if
    the prefix were written in front of it (a prompt shared by several continuations, packed once:
    ``nemo_orchestra/train/packing.py``). A prefix sequence attends causally to itself and continues
    none. Shapes and heads as in ``varlen_attention_ref``; returns out_THD. One sequence at a time
    (``nemo_orchestra.kernels.cpu_attention.attend``), a continuation's with its prefix's keys and values in front
    and a bottom-right causal mask. Differentiable: a prefix's keys and values get every
    continuation's gradient. With ``rows_N`` (ascending positions in the pack) only those queries are
    computed: out_NHD, the whole pack's output at those rows.
    """
    cu = check_varlen_inputs(q_THD, k_THD, v_THD, cu_seqlens_B1, q_THD.shape[0])
    if len(prefix_B) != len(cu) - 1:
        raise ValueError(f"prefix_B must name one prefix per sequence ({len(cu) - 1}), got {len(prefix_B)}")
    for b, p in enumerate(prefix_B):
        if p >= 0 and (p >= len(prefix_B) or p == b or prefix_B[p] >= 0):
            raise ValueError(f"sequence {b}: prefix {p} is not another sequence without a prefix of its own")
    D = q_THD.shape[2]
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    lens, qs, ks, vs = _per_sequence(q_THD, k_THD, v_THD, cu)
    outs = []
    for b, (p, rows_n) in enumerate(zip(prefix_B, rows_per_sequence(rows_N, cu))):
        if (lens[b] if rows_n is None else rows_n.numel()) == 0:
            continue
        if p < 0:
            o_HLD = attend(qs[b], ks[b], vs[b], offset=0, scale=scale, rows_N=rows_n)
        else:
            k_HKD, v_HKD = torch.cat([ks[p], ks[b]], dim=1), torch.cat([vs[p], vs[b]], dim=1)
            # query i (of n) sees the lens[p] prefix keys and its own keys 0..i
            o_HLD = attend(qs[b], k_HKD, v_HKD, offset=lens[p], scale=scale, rows_N=rows_n)
        outs.append(o_HLD.transpose(0, 1))
    if outs:
        return torch.cat(outs, dim=0)
    return q_THD.clone() if rows_N is None else q_THD.index_select(0, rows_N)


def rows_per_sequence(rows_N: torch.Tensor | None, cu: list[int]) -> list[torch.Tensor | None]:
    """Per sequence, the positions of ``rows_N`` (ascending, in the pack) inside it, from its start;
    all None without rows."""
    if rows_N is None:
        return [None] * (len(cu) - 1)
    bounds = torch.searchsorted(rows_N, torch.tensor(cu, dtype=rows_N.dtype, device=rows_N.device)).tolist()
    return [rows_N[lo:hi] - start for lo, hi, start in zip(bounds[:-1], bounds[1:], cu[:-1])]


def _per_sequence(q_THD, k_THD, v_THD, cu: list[int]):
    """Sequence lengths and each sequence's q, k, v as [H, L, D] views, key/value heads repeated to the
    query heads. One split, not a slice per sequence: a slice's backward writes a zero tensor the size
    of the whole pack."""
    rep = q_THD.shape[1] // k_THD.shape[1]
    q_HTD = q_THD.transpose(0, 1)
    k_HTD, v_HTD = (
        x.transpose(0, 1).repeat_interleave(rep, dim=0) if rep > 1 else x.transpose(0, 1) for x in (k_THD, v_THD)
    )
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    return (lens, *(x.split(lens, dim=1) for x in (q_HTD, k_HTD, v_HTD)))


def _lse(q_HLD, k_HLD, scale, causal):
    scores_HLL = torch.matmul(q_HLD.float(), k_HLD.float().transpose(1, 2)) * scale
    if causal:
        L = scores_HLL.shape[-1]
        future = torch.ones(L, L, dtype=torch.bool, device=q_HLD.device).triu_(1)
        scores_HLL = scores_HLL.masked_fill(future, float("-inf"))
    return torch.logsumexp(scores_HLL, dim=-1)


def grouped_advantage_ref(rewards_N, *, group_ids=None, offsets=None, mode="std", eps=1e-6, clip=None):
    """Group-relative advantages (GRPO) of ``rewards_N``, grouped by ``group_ids`` or ``offsets``.

    Groups are given either as unsorted ids (``group_ids``, [N], any integer values) or as sorted
    offsets (``offsets``, [G+1]: group g is rewards[offsets[g]:offsets[g+1]]). With mean and std
    taken within the group of reward r_i (n rewards):

    - ``mean`` (Dr. GRPO):  A_i = r_i - mean
    - ``std`` (GRPO):       A_i = (r_i - mean) / (std + eps), std the SAMPLE standard deviation
      sqrt(sum (r - mean)^2 / (n - 1)) (Bessel's correction, as ToolOrchestra uses)
    - ``loo`` (leave-one-out baseline): A_i = r_i - mean of the other n-1 = n/(n-1) * (r_i - mean)

    then, when ``clip`` is set, A_i is clamped to [-clip, clip]. A group of size 1 and a group whose
    rewards are all equal give exactly 0 (never NaN): the mean is computed around a member of the
    group (pivot + mean of (r - pivot)), so equal rewards give an exact zero deviation. Arithmetic is
    fp32 (fp64 for fp64 rewards); the result has the dtype of ``rewards_N``.
    """
    check_advantage_inputs(rewards_N, group_ids, offsets, mode, eps, clip)
    acc = torch.float64 if rewards_N.dtype == torch.float64 else torch.float32
    r_N = rewards_N.to(acc)
    if offsets is not None:
        sizes_G = offsets[1:] - offsets[:-1]
        G = sizes_G.numel()
        gid_N = torch.repeat_interleave(torch.arange(G, device=r_N.device), sizes_G.long(), output_size=r_N.numel())
    else:
        uniq, gid_N = torch.unique(group_ids, return_inverse=True)
        G = uniq.numel()
    n_G = torch.zeros(G, dtype=acc, device=r_N.device).index_add_(0, gid_N, torch.ones_like(r_N))
    # Pivot: any member of the group works; the largest is deterministic.
    pivot_G = torch.zeros(G, dtype=acc, device=r_N.device).scatter_reduce_(0, gid_N, r_N, "amax", include_self=False)
    shifted_N = r_N - pivot_G[gid_N]
    mean_G = pivot_G + torch.zeros_like(n_G).index_add_(0, gid_N, shifted_N) / n_G.clamp(min=1)
    dev_N = r_N - mean_G[gid_N]
    many_G = n_G > 1
    if mode == "mean":
        adv_N = dev_N
    elif mode == "loo":
        adv_N = dev_N * torch.where(many_G, n_G / (n_G - 1).clamp(min=1), 0.0)[gid_N]
    else:
        ss_G = torch.zeros_like(n_G).index_add_(0, gid_N, dev_N * dev_N)
        denom_G = torch.where(many_G, ss_G / (n_G - 1).clamp(min=1), 0.0).sqrt() + eps
        denom_N = denom_G[gid_N]
        adv_N = torch.where(denom_N > 0, dev_N / denom_N.clamp(min=torch.finfo(acc).tiny), 0.0)
    if clip is not None:
        adv_N = adv_N.clamp(-clip, clip)
    return adv_N.to(rewards_N.dtype)
