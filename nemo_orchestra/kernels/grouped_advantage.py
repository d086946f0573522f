"""Group-relative advantages (GRPO) in Triton: one pass over the rewards, one over the advantages.

Shapes (legend): N rewards, G groups; ``offsets_G1`` holds G+1 sorted offsets. The math (modes
``mean``, ``std`` with the sample std, ``loo``; clip; zeros for size-1 and all-equal groups) is
specified by ``nemo_orchestra.kernels.reference.grouped_advantage_ref``.

Each program normalizes GROUPS consecutive groups held as a [GROUPS, BLOCK_N] tile (row = group),
so groups of a handful of rewards still give wide, contiguous loads. When every group fits in
BLOCK_N (ONE_CHUNK) the tile stays in registers: rewards are read once and advantages written
once. Larger groups are walked in chunks (three passes: shifted sum, squared deviations, write;
the re-reads hit cache). Unsorted ``group_ids`` are sorted on the host side (a stable argsort); the
kernel then gathers rewards and scatters advantages through that permutation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nemo_orchestra import kernels
from nemo_orchestra.kernels.checks import check_advantage_inputs

MODES = {"mean": 0, "std": 1, "loo": 2}
MAX_BLOCK_N = 1024  # widest group tile kept in registers
TILE = 4096  # rewards per program (GROUPS * BLOCK_N) when groups are small


@triton.jit
def _load_rewards(R, PERM, idx, mask, HAS_PERM: tl.constexpr, ACC: tl.constexpr):
    if HAS_PERM:
        idx = tl.load(PERM + idx, mask=mask, other=0)
    return tl.load(R + idx, mask=mask, other=0.0).to(ACC), idx


@triton.jit
def _finish(dev, n, ss, eps, clip, MODE: tl.constexpr, HAS_CLIP: tl.constexpr):
    """Advantages of deviations ``dev`` [GROUPS, BLOCK_N] from groups of sizes ``n`` (sum of squares ``ss``)."""
    nf = n.to(dev.dtype)
    many = n > 1
    if MODE == 0:
        adv = dev
    elif MODE == 1:
        std = tl.sqrt(tl.where(many, ss / tl.maximum(nf - 1.0, 1.0), 0.0))
        denom = std + eps
        adv = tl.where(denom[:, None] > 0, dev / tl.where(denom > 0, denom, 1.0)[:, None], 0.0)
    else:  # leave-one-out: r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean)
        adv = dev * tl.where(many, nf / tl.maximum(nf - 1.0, 1.0), 0.0)[:, None]
    if HAS_CLIP:
        adv = tl.minimum(tl.maximum(adv, -clip), clip)
    return adv


@triton.jit
def _grouped_advantage_kernel(
    R,
    PERM,
    OFF,
    A,
    G,
    n_chunks,
    eps,
    clip,
    MODE: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    HAS_PERM: tl.constexpr,
    ACC: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    gs = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    mask_g = gs < G
    lo = tl.load(OFF + gs, mask=mask_g, other=0).to(tl.int64)
    n = tl.load(OFF + gs + 1, mask=mask_g, other=0).to(tl.int64) - lo
    cols = tl.arange(0, BLOCK_N)
    # Mean around a member of the group (its first reward): all-equal rewards give exactly 0.
    pivot = _load_rewards(R, PERM, lo, mask_g & (n > 0), HAS_PERM, ACC)[0]
    if ONE_CHUNK:
        m = cols[None, :] < n[:, None]
        r, idx = _load_rewards(R, PERM, lo[:, None] + cols[None, :], m, HAS_PERM, ACC)
        mean = pivot + tl.sum(tl.where(m, r - pivot[:, None], 0.0), 1) / tl.maximum(n, 1).to(ACC)
        dev = r - mean[:, None]
        ss = tl.sum(tl.where(m, dev * dev, 0.0), 1)
        adv = _finish(dev, n, ss, eps, clip, MODE, HAS_CLIP)
        tl.store(A + idx, adv.to(A.dtype.element_ty), mask=m)
    else:
        s1 = tl.zeros([GROUPS], ACC)
        for c in range(n_chunks):
            m = (c * BLOCK_N + cols)[None, :] < n[:, None]
            r = _load_rewards(R, PERM, lo[:, None] + c * BLOCK_N + cols[None, :], m, HAS_PERM, ACC)[0]
            s1 += tl.sum(tl.where(m, r - pivot[:, None], 0.0), 1)
        mean = pivot + s1 / tl.maximum(n, 1).to(ACC)
        ss = tl.zeros([GROUPS], ACC)
        if MODE == 1:
            for c in range(n_chunks):
                m = (c * BLOCK_N + cols)[None, :] < n[:, None]
                r = _load_rewards(R, PERM, lo[:, None] + c * BLOCK_N + cols[None, :], m, HAS_PERM, ACC)[0]
                dev = tl.where(m, r - mean[:, None], 0.0)
                ss += tl.sum(dev * dev, 1)
        for c in range(n_chunks):
            m = (c * BLOCK_N + cols)[None, :] < n[:, None]
            r, idx = _load_rewards(R, PERM, lo[:, None] + c * BLOCK_N + cols[None, :], m, HAS_PERM, ACC)
            adv = _finish(r - mean[:, None], n, ss, eps, clip, MODE, HAS_CLIP)
            tl.store(A + idx, adv.to(A.dtype.element_ty), mask=m)


def tile_shape(max_group: int) -> tuple[int, int, int]:
    """(GROUPS, BLOCK_N, n_chunks) for groups of at most ``max_group`` rewards."""
    block_n = min(max(triton.next_power_of_2(max(max_group, 1)), 16), MAX_BLOCK_N)
    return max(1, TILE // block_n), block_n, triton.cdiv(max(max_group, 1), block_n)


def grouped_advantage_launch(rewards_N, offsets_G1, max_group, mode, eps, clip, perm_N=None, out=None):
    """Kernel launch for sorted ``offsets_G1`` (``perm_N``: rewards of group g are rewards_N[perm_N[lo:hi]])."""
    G = offsets_G1.numel() - 1
    out = torch.empty_like(rewards_N) if out is None else out
    if rewards_N.numel() == 0 or G == 0:
        return out
    groups, block_n, n_chunks = tile_shape(max_group)
    if kernels.triton_interpret():
        groups = min(groups, 16)  # keep interpreter tiles small
    acc = tl.float64 if rewards_N.dtype == torch.float64 else tl.float32
    _grouped_advantage_kernel[(triton.cdiv(G, groups),)](
        rewards_N,
        offsets_G1 if perm_N is None else perm_N,
        offsets_G1,
        out,
        G,
        n_chunks,
        float(eps),
        float(clip or 0.0),
        MODE=MODES[mode],
        HAS_CLIP=clip is not None,
        HAS_PERM=perm_N is not None,
        ACC=acc,
        GROUPS=groups,
        BLOCK_N=block_n,
        ONE_CHUNK=n_chunks == 1,
        num_warps=4 if block_n * groups <= 2048 else 8,
    )
    return out


def grouped_advantage(rewards, *, group_ids=None, offsets=None, mode="std", eps=1e-6, clip=None):
    """Group-relative advantages of ``rewards`` [N]: see ``nemo_orchestra.kernels.reference.grouped_advantage_ref``.

    Groups are sorted ``offsets`` [G+1] or unsorted ``group_ids`` [N]. Modes ``mean`` (r - mean),
    ``std`` ((r - mean) / (std + eps), std the SAMPLE std with Bessel's n-1, as ToolOrchestra)
    and ``loo`` (r_i - mean of the others); optional symmetric ``clip``. Size-1 and all-equal
    groups give 0. CPU tensors run the reference unless ``TRITON_INTERPRET=1``.
    """
    if not kernels.use_triton(rewards):
        from nemo_orchestra.kernels.reference import grouped_advantage_ref

        return grouped_advantage_ref(rewards, group_ids=group_ids, offsets=offsets, mode=mode, eps=eps, clip=clip)
    check_advantage_inputs(rewards, group_ids, offsets, mode, eps, clip)
    rewards = rewards.contiguous()
    perm = None
    if group_ids is not None:
        if rewards.numel() == 0:
            return torch.empty_like(rewards)
        sorted_ids, perm = torch.sort(group_ids, stable=True)
        counts = torch.unique_consecutive(sorted_ids, return_counts=True)[1]
        offsets = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))
    else:
        offsets = offsets.contiguous()
        counts = offsets[1:] - offsets[:-1]
    max_group = int(counts.max()) if counts.numel() else 0
    return grouped_advantage_launch(rewards, offsets, max_group, mode, eps, clip, perm_N=perm)


kernels.make_op_module_callable(__name__, grouped_advantage)
