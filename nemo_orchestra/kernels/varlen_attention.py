"""Flash attention over packed variable-length sequences (THD + cu_seqlens), forward and backward.

Shapes (legend): T total tokens, Hq query heads, Hkv key/value heads (GQA: query head h reads
key/value head h // (Hq // Hkv)), D head dim, B sequences; cu_seqlens_B1 holds B+1 int32 offsets.
The spec is ``nemo_orchestra.kernels.reference.varlen_attention_ref``.

Forward: one program per (q block, sequence, q head) walks the key blocks of its sequence with an
online softmax (running max m, running sum l, fp32 accumulator), in base 2 (exp2 with the scale
folded into log2(e)). Causal key blocks past the diagonal are never visited; only the diagonal
block and a sequence's ragged last block pay for masks. It stores out and lse = m + log(l).

Backward: a preprocess kernel computes delta = rowsum(dO * O) (minus the lse gradient); a dK/dV
kernel (program per key block, sequence, kv head) walks the query blocks of every query head of its
group, so GQA needs no atomics; a dQ kernel (program per query block, sequence, q head) walks the
key blocks. Both recompute P from the saved lse instead of storing it.

Tiles are loaded in the input dtype and fed to tensor-core dots (bf16/fp16, tf32 for fp32) with
fp32 accumulation. The Triton interpreter computes bf16 wrongly, so there (UPCAST) tiles are
converted to fp32 right after loading.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nemo_orchestra import kernels
from nemo_orchestra.kernels.checks import check_varlen_inputs

LOG2E = 1.4426950408889634  # (written out as literals inside the kernels, with ln(2) = 0.6931471805599453)
MAX_HEAD_DIM = 256
SHARED_MEMORY_BUDGET = 160 * 1024  # bytes; H100 has 228 KiB per SM


# ---------------------------------------------------------------------------------------------
# Autotune configs, as data. keep() drops configs that break the loop structure below: a program
# owns one block (outer) and steps along the diagonal by the other, so outer must be a multiple of it.
# ---------------------------------------------------------------------------------------------


def _configs(blocks, warps, stages, interpret_blocks, short):
    """The autotuner's candidates. Each is compiled and timed once per autotune key, so the default is
    ``short`` (a few (BLOCK_M, BLOCK_N, warps, stages) picks); NEMO_ORCHESTRA_AUTOTUNE=full searches the
    product of blocks x warps x stages."""
    if kernels.triton_interpret():  # one small config: the interpreter proves correctness, not speed
        bm, bn = interpret_blocks
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=1)]
    if os.environ.get("NEMO_ORCHESTRA_AUTOTUNE", "short") != "full":
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in short]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn in blocks
        for w in warps
        for s in stages
    ]


def keep(conf, outer):
    inner = "BLOCK_N" if outer == "BLOCK_M" else "BLOCK_M"
    return conf.kwargs[outer] % conf.kwargs[inner] == 0


FWD_CONFIGS = [
    c
    for c in _configs(
        [(128, 64), (128, 128), (64, 64), (128, 32)],
        [4, 8],
        [2, 3, 4],
        (16, 16),
        short=[(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 2), (128, 32, 4, 3)],
    )
    if keep(c, outer="BLOCK_M")
]  # a q block, stepped by key blocks
DKDV_CONFIGS = [
    c
    for c in _configs(
        [(32, 128), (64, 128), (32, 64), (64, 64)],
        [4, 8],
        [2, 3],
        (16, 32),
        short=[(32, 128, 4, 2), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3)],
    )
    if keep(c, outer="BLOCK_N")
]  # a key block, stepped by q blocks
DQ_CONFIGS = [
    c
    for c in _configs(
        [(128, 32), (128, 64), (64, 64), (64, 32)],
        [4, 8],
        [2, 3],
        (32, 16),
        short=[(128, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3)],
    )
    if keep(c, outer="BLOCK_M")
]


def prune_by_shared_memory(configs, named_args, **kwargs):
    """Drop tiles whose pipelined loads would overflow shared memory (a rough estimate: both tiles'
    rows times the stages); configs that still do not fit fail to launch and the autotuner skips them."""
    row_bytes = kwargs["BLOCK_D"] * named_args["Q"].element_size()
    fits = [
        c
        for c in configs
        if row_bytes * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.num_stages <= SHARED_MEMORY_BUDGET
    ]
    return fits or [min(configs, key=lambda c: (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.num_stages)]


PRUNE = {"early_config_prune": prune_by_shared_memory}
AUTOTUNE_KEY = ["seqlen_bucket", "BLOCK_D", "GROUP", "CAUSAL"]  # (+ dtypes, added by the autotuner)


def seqlen_bucket(max_seqlen: int) -> int:
    return min(triton.next_power_of_2(max(int(max_seqlen), 1)), 16384)


@triton.jit
def _to_output(x, OUT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """Downcast for a store. The interpreter truncates fp32 -> bf16 (and ignores
    fp_downcast_rounding), so under UPCAST round to nearest-even by hand, as the GPU does."""
    if UPCAST:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(OUT_DTYPE)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_ptrs,
    v_ptrs,
    stride_kt,
    stride_vt,
    offs_m,
    offs_n,
    mask_d,
    L,
    lo,
    hi,
    qk_scale,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASK:
            k = tl.load(k_ptrs + start_n * stride_kt, mask=(cols < L)[None, :] & mask_d[:, None], other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vt, mask=(cols < L)[:, None] & mask_d[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs + start_n * stride_kt, mask=mask_d[:, None], other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vt, mask=mask_d[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASK:
            valid = (cols < L)[None, :]
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=FWD_CONFIGS, key=AUTOTUNE_KEY, prune_configs_by=PRUNE)
@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    CU,
    qk_scale,
    seqlen_bucket,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Longest-running (last) q blocks first: better tail balance under causal masking.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq, h = tl.program_id(1), tl.program_id(2)
    start = tl.load(CU + seq).to(tl.int64)
    L = tl.load(CU + seq + 1) - start.to(tl.int32)
    start_m = m_block * BLOCK_M
    if start_m >= L:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_m = offs_m < L
    hk = h // GROUP
    q = tl.load(
        Q + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_ptrs = K + (start + offs_n)[None, :] * stride_kt + hk * stride_kh + offs_d[:, None]  # K^T tile
    v_ptrs = V + (start + offs_n)[:, None] * stride_vt + hk * stride_vh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Key blocks left of this q block (causal) or all whole key blocks (not causal) need no mask.
    full_hi = start_m if CAUSAL else (L // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M, L) if CAUSAL else L
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_ptrs,
        v_ptrs,
        stride_kt,
        stride_vt,
        offs_m,
        offs_n,
        mask_d,
        L,
        0,
        full_hi,
        qk_scale,
        BLOCK_N,
        CAUSAL,
        False,
        UPCAST,
    )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_ptrs,
        v_ptrs,
        stride_kt,
        stride_vt,
        offs_m,
        offs_n,
        mask_d,
        L,
        full_hi,
        hi,
        qk_scale,
        BLOCK_N,
        CAUSAL,
        True,
        UPCAST,
    )
    acc = acc / l_i[:, None]
    tl.store(
        O + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        _to_output(acc, O.dtype.element_ty, UPCAST),
        mask=mask_m[:, None] & mask_d[None, :],
    )
    tl.store(LSE + h * stride_lh + start + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=mask_m)


# ---------------------------------------------------------------------------------------------
# Backward. With S = scale * Q K^T (one sequence, one head; causal entries masked to -inf),
# P = softmax(S) = exp(S - lse) row-wise, O = P V, and the loss gradients dO (and dlse, if the
# caller used lse):
#   dV   = P^T dO
#   dP   = dO V^T
#   dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik) + dlse_i P_ij                 (softmax Jacobian; lse' = P)
#         = P_ij (dP_ij - Delta_i),   Delta_i = sum_k P_ik dP_ik - dlse_i = rowsum(dO * O)_i - dlse_i
#         since sum_k P_ik dP_ik = sum_k P_ik (dO_i . V_k) = dO_i . O_i
#   dQ   = scale * dS K,     dK = scale * dS^T Q
# P is recomputed from the saved lse (P = exp2(S log2(e) - lse log2(e))), never stored. For GQA,
# dK and dV of a kv head sum over the Hq/Hkv query heads that read it.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess_kernel(
    O,
    DO,
    DLSE,
    DELTA,
    T,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_dlh,
    stride_deltah,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    h = tl.program_id(1)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + offs_t[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + offs_t[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + h * stride_dlh + offs_t, mask=mask_t, other=0.0)
    tl.store(DELTA + h * stride_deltah + offs_t, delta, mask=mask_t)


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    qT_ptrs,
    do_ptrs,
    lse_ptrs,
    delta_ptrs,
    stride_qt,
    stride_dot,
    offs_m,
    offs_n,
    mask_d,
    L,
    lo,
    hi,
    qk_scale,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        if MASK:
            qT = tl.load(qT_ptrs + start_m * stride_qt, mask=(rows < L)[None, :] & mask_d[:, None], other=0.0)
            do = tl.load(do_ptrs + start_m * stride_dot, mask=(rows < L)[:, None] & mask_d[None, :], other=0.0)
            lse = tl.load(lse_ptrs + start_m, mask=rows < L, other=0.0)
            delta = tl.load(delta_ptrs + start_m, mask=rows < L, other=0.0)
        else:
            qT = tl.load(qT_ptrs + start_m * stride_qt, mask=mask_d[:, None], other=0.0)
            do = tl.load(do_ptrs + start_m * stride_dot, mask=mask_d[None, :], other=0.0)
            lse = tl.load(lse_ptrs + start_m)
            delta = tl.load(delta_ptrs + start_m)
        if UPCAST:
            qT = qT.to(tl.float32)
            do = do.to(tl.float32)
        pT = tl.math.exp2(tl.dot(k, qT) * qk_scale - (lse * 1.4426950408889634)[None, :])  # [BLOCK_N, BLOCK_M]
        if MASK:
            valid = (rows < L)[None, :]
            if CAUSAL:
                valid = valid & (rows[None, :] >= offs_n[:, None])
            pT = tl.where(valid, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
    return dk, dv


@triton.autotune(configs=DKDV_CONFIGS, key=AUTOTUNE_KEY, prune_configs_by=PRUNE)
@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    CU,
    qk_scale,
    sm_scale,
    seqlen_bucket,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_lh,
    stride_deltah,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq, hk = tl.program_id(1), tl.program_id(2)
    start = tl.load(CU + seq).to(tl.int64)
    L = tl.load(CU + seq + 1) - start.to(tl.int32)
    start_n = tl.program_id(0) * BLOCK_N
    if start_n >= L:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_nd = (offs_n < L)[:, None] & mask_d[None, :]
    k = tl.load(K + (start + offs_n)[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=mask_nd, other=0.0)
    v = tl.load(V + (start + offs_n)[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=mask_nd, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Query rows: [lo, mid) cross the diagonal (masked), [mid, full) are whole unmasked blocks,
    # [full, L) is the ragged tail (masked). Not causal: every row, no diagonal.
    lo = start_n if CAUSAL else 0
    mid = tl.minimum(start_n + BLOCK_N, L) if CAUSAL else 0
    full = mid + ((L - mid) // BLOCK_M) * BLOCK_M
    for g in range(GROUP):
        h = hk * GROUP + g
        qT_ptrs = Q + (start + offs_m)[None, :] * stride_qt + h * stride_qh + offs_d[:, None]
        do_ptrs = DO + (start + offs_m)[:, None] * stride_dot + h * stride_doh + offs_d[None, :]
        lse_ptrs = LSE + h * stride_lh + start + offs_m
        delta_ptrs = DELTA + h * stride_deltah + start + offs_m
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            qT_ptrs,
            do_ptrs,
            lse_ptrs,
            delta_ptrs,
            stride_qt,
            stride_dot,
            offs_m,
            offs_n,
            mask_d,
            L,
            lo,
            mid,
            qk_scale,
            BLOCK_M,
            CAUSAL,
            True,
            UPCAST,
        )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            qT_ptrs,
            do_ptrs,
            lse_ptrs,
            delta_ptrs,
            stride_qt,
            stride_dot,
            offs_m,
            offs_n,
            mask_d,
            L,
            mid,
            full,
            qk_scale,
            BLOCK_M,
            CAUSAL,
            False,
            UPCAST,
        )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            qT_ptrs,
            do_ptrs,
            lse_ptrs,
            delta_ptrs,
            stride_qt,
            stride_dot,
            offs_m,
            offs_n,
            mask_d,
            L,
            full,
            L,
            qk_scale,
            BLOCK_M,
            CAUSAL,
            True,
            UPCAST,
        )
    tl.store(
        DK + (start + offs_n)[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :],
        _to_output(dk * sm_scale, DK.dtype.element_ty, UPCAST),
        mask=mask_nd,
    )
    tl.store(
        DV + (start + offs_n)[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :],
        _to_output(dv, DV.dtype.element_ty, UPCAST),
        mask=mask_nd,
    )


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    kT_ptrs,
    vT_ptrs,
    stride_kt,
    stride_vt,
    offs_m,
    offs_n,
    mask_d,
    L,
    lo,
    hi,
    qk_scale,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASK:
            kT = tl.load(kT_ptrs + start_n * stride_kt, mask=(cols < L)[None, :] & mask_d[:, None], other=0.0)
            vT = tl.load(vT_ptrs + start_n * stride_vt, mask=(cols < L)[None, :] & mask_d[:, None], other=0.0)
        else:
            kT = tl.load(kT_ptrs + start_n * stride_kt, mask=mask_d[:, None], other=0.0)
            vT = tl.load(vT_ptrs + start_n * stride_vt, mask=mask_d[:, None], other=0.0)
        if UPCAST:
            kT = kT.to(tl.float32)
            vT = vT.to(tl.float32)
        p = tl.math.exp2(tl.dot(q, kT) * qk_scale - lse2[:, None])  # [BLOCK_M, BLOCK_N]
        if MASK:
            valid = (cols < L)[None, :]
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, vT)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    return dq


@triton.autotune(configs=DQ_CONFIGS, key=AUTOTUNE_KEY, prune_configs_by=PRUNE)
@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    CU,
    qk_scale,
    sm_scale,
    seqlen_bucket,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_lh,
    stride_deltah,
    stride_dqt,
    stride_dqh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq, h = tl.program_id(1), tl.program_id(2)
    start = tl.load(CU + seq).to(tl.int64)
    L = tl.load(CU + seq + 1) - start.to(tl.int32)
    start_m = m_block * BLOCK_M
    if start_m >= L:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_m = offs_m < L
    mask_md = mask_m[:, None] & mask_d[None, :]
    hk = h // GROUP
    q = tl.load(Q + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask_md, other=0.0)
    do = tl.load(
        DO + (start + offs_m)[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask_md, other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(LSE + h * stride_lh + start + offs_m, mask=mask_m, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + h * stride_deltah + start + offs_m, mask=mask_m, other=0.0)
    kT_ptrs = K + (start + offs_n)[None, :] * stride_kt + hk * stride_kh + offs_d[:, None]
    vT_ptrs = V + (start + offs_n)[None, :] * stride_vt + hk * stride_vh + offs_d[:, None]
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_hi = start_m if CAUSAL else (L // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M, L) if CAUSAL else L
    dq = _dq_inner(
        dq,
        q,
        do,
        lse2,
        delta,
        kT_ptrs,
        vT_ptrs,
        stride_kt,
        stride_vt,
        offs_m,
        offs_n,
        mask_d,
        L,
        0,
        full_hi,
        qk_scale,
        BLOCK_N,
        CAUSAL,
        False,
        UPCAST,
    )
    dq = _dq_inner(
        dq,
        q,
        do,
        lse2,
        delta,
        kT_ptrs,
        vT_ptrs,
        stride_kt,
        stride_vt,
        offs_m,
        offs_n,
        mask_d,
        L,
        full_hi,
        hi,
        qk_scale,
        BLOCK_N,
        CAUSAL,
        True,
        UPCAST,
    )
    tl.store(
        DQ + (start + offs_m)[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
        _to_output(dq * sm_scale, DQ.dtype.element_ty, UPCAST),
        mask=mask_md,
    )


# ---------------------------------------------------------------------------------------------
# Launchers (trust their inputs; ``out=``-style buffers let tests poison the memory around them),
# the autograd Function and the public op.
# ---------------------------------------------------------------------------------------------


def _meta(q, k, causal):
    D = q.shape[2]
    return dict(
        GROUP=q.shape[1] // k.shape[1],
        HEAD_DIM=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        CAUSAL=bool(causal),
        UPCAST=kernels.triton_interpret() and q.dtype == torch.bfloat16,
    )


def varlen_fwd(q, k, v, cu_seqlens, max_seqlen, causal, scale, out=None, lse=None):
    """Forward launch: writes out [T, Hq, D] (q's dtype) and lse [Hq, T] (fp32); returns both."""
    T, Hq, D = q.shape
    B = cu_seqlens.numel() - 1
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty((Hq, T), dtype=torch.float32, device=q.device) if lse is None else lse
    if T == 0:
        return out, lse
    grid = lambda META: (triton.cdiv(max_seqlen, META["BLOCK_M"]), B, Hq)  # noqa: E731
    _fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens,
        scale * LOG2E,
        seqlen_bucket(max_seqlen),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        **_meta(q, k, causal),
    )
    return out, lse


def varlen_bwd(do, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale, dlse=None, dq=None, dk=None, dv=None):
    """Backward launch: returns dq, dk, dv (shapes and dtypes of q, k, v)."""
    T, Hq, D = q.shape
    Hkv, B = k.shape[1], cu_seqlens.numel() - 1
    dq = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device) if dq is None else dq
    dk = torch.empty((T, Hkv, D), dtype=k.dtype, device=k.device) if dk is None else dk
    dv = torch.empty((T, Hkv, D), dtype=v.dtype, device=v.device) if dv is None else dv
    if T == 0:
        return dq, dk, dv
    meta = _meta(q, k, causal)
    delta = torch.empty((Hq, T), dtype=torch.float32, device=q.device)
    block_t = 16 if kernels.triton_interpret() else 64
    _bwd_preprocess_kernel[(triton.cdiv(T, block_t), Hq)](
        out,
        do,
        lse if dlse is None else dlse,
        delta,
        T,
        out.stride(0),
        out.stride(1),
        do.stride(0),
        do.stride(1),
        0 if dlse is None else dlse.stride(0),
        delta.stride(0),
        HEAD_DIM=D,
        BLOCK_D=meta["BLOCK_D"],
        HAS_DLSE=dlse is not None,
        BLOCK_T=block_t,
    )
    common = (
        scale * LOG2E,
        scale,
        seqlen_bucket(max_seqlen),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        do.stride(0),
        do.stride(1),
        lse.stride(0),
        delta.stride(0),
    )
    grid_kv = lambda META: (triton.cdiv(max_seqlen, META["BLOCK_N"]), B, Hkv)  # noqa: E731
    _bwd_dkdv_kernel[grid_kv](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        cu_seqlens,
        *common,
        dk.stride(0),
        dk.stride(1),
        dv.stride(0),
        dv.stride(1),
        **meta,
    )
    grid_q = lambda META: (triton.cdiv(max_seqlen, META["BLOCK_M"]), B, Hq)  # noqa: E731
    _bwd_dq_kernel[grid_q](q, k, v, do, lse, delta, dq, cu_seqlens, *common, dq.stride(0), dq.stride(1), **meta)
    return dq, dk, dv


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


class VarlenAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, causal, scale):
        out, lse = varlen_fwd(q, k, v, cu_seqlens, max_seqlen, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.causal, ctx.scale = max_seqlen, causal, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else _last_dim_contiguous(dout)
        dlse = None if dlse is None else dlse.contiguous()
        dq, dk, dv = varlen_bwd(dout, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.causal, ctx.scale, dlse)
        return dq, dk, dv, None, None, None, None


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, causal=True, softmax_scale=None):
    """Attention over packed sequences: q [T, Hq, D], k and v [T, Hkv, D] -> (out [T, Hq, D], lse [Hq, T] fp32).

    Sequence b is tokens cu_seqlens[b]:cu_seqlens[b+1] (int32 [B+1], on q's device); ``max_seqlen``
    bounds their lengths. Semantics are those of ``nemo_orchestra.kernels.reference.varlen_attention_ref``.
    fp32, fp16 and bf16 inputs (fp32 accumulation; GPU fp32 dots use tf32), head dims up to 256.
    Gradients flow to q, k, v from both outputs. Tensors not on CUDA run the reference, unless
    ``TRITON_INTERPRET=1``.
    """
    if not kernels.use_triton(q):
        from nemo_orchestra.kernels.reference import varlen_attention_ref

        return varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale)
    check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen)
    D = q.shape[2]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim must be <= {MAX_HEAD_DIM}, got {D}")
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    return VarlenAttentionFunction.apply(q, k, v, cu_seqlens, int(max_seqlen), bool(causal), scale)


kernels.make_op_module_callable(__name__, varlen_attention)
