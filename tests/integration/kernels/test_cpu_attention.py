"""The CPU attention path (``nemo_orchestra.kernels.cpu_attention``): blocks of queries with kept probabilities and
a backward of its own, against autograd through the plain math and against SDPA."""

import pytest
import torch

from nemo_orchestra.kernels import cpu_attention
from nemo_orchestra.kernels.cpu_attention import BLOCK, BlockedAttention, attend


def math_attention(q, k, v, offset, scale, rows=None):
    """softmax(scale q k^T, query i sees keys j <= offset + i) v, in q's dtype, by autograd; with
    ``rows`` the output of those queries only."""
    s = torch.matmul(q, k.transpose(1, 2)) * scale
    if offset is not None:
        L, S = s.shape[1:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu_(offset + 1), float("-inf"))
    out = torch.matmul(torch.softmax(s, dim=-1), v)
    return out if rows is None else out[:, rows]


def qkv(H, L, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(H, n, D, generator=g) * 1.5).to(dtype).requires_grad_() for n in (L, S, S)]


# lengths around the block size: shorter than a block, a block and one token, several blocks
CASES = [(5, 5, 0), (BLOCK + 1, BLOCK + 1, 0), (3 * BLOCK - 7, 3 * BLOCK - 7, 0), (70, 70 + 41, 41), (130, 131, 1)]


@pytest.mark.parametrize("L,S,offset", [*CASES, (70, 70, None), (9, 150, None)])
def test_the_backward_is_the_gradient_of_the_forward(L, S, offset):
    q, k, v = qkv(2, L, S, 8, torch.float64)
    pos = None if offset is None else torch.arange(L) + offset
    assert torch.autograd.gradcheck(lambda q, k, v: BlockedAttention.apply(q, k, v, pos, 0.3), (q, k, v))


@pytest.mark.parametrize("L,S,offset", [*CASES, (70, 70, None)])
def test_fp32_equals_the_math_with_its_gradients(L, S, offset):
    q, k, v = qkv(4, L, S, 64, torch.float32, seed=1)
    do = torch.randn(4, L, 64)
    got = attend(q, k, v, offset=offset, scale=0.125)
    grads = torch.autograd.grad(got, (q, k, v), do)
    want = math_attention(q, k, v, offset, 0.125)
    want_grads = torch.autograd.grad(want, (q, k, v), do)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("L,S,offset", [(300, 520, 220), (220, 220, 0)])
@pytest.mark.parametrize("seed", [2, 3])
def test_bf16_meets_the_flash_attention_precision_rule(L, S, offset, seed):
    """bf16 inputs (scores and softmax in fp32, probabilities and the softmax gradient in bf16 for the
    products, as flash attention on a GPU): against fp32 math of the same inputs, the error of the
    output and of each gradient is at most twice that of the plain math in bf16, plus a floor
    (flash-attention's rule, as ``test_varlen_attention.py``)."""
    q, k, v = qkv(4, L, S, 64, torch.bfloat16, seed=seed)
    do = torch.randn(4, L, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    exact = [x.detach().float().requires_grad_() for x in (q, k, v)]

    def results(fn, q, k, v, do):
        out = fn(q, k, v)
        return [out, *torch.autograd.grad(out, (q, k, v), do)]

    want = results(lambda q, k, v: math_attention(q, k, v, offset, 0.125), *exact, do.float())
    plain = results(lambda q, k, v: math_attention(q, k, v, offset, 0.125), q, k, v, do)
    ours = results(lambda q, k, v: attend(q, k, v, offset=offset, scale=0.125), q, k, v, do)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), ours, plain, want):
        err, err_plain = (a.float() - c).abs().max().item(), (b.float() - c).abs().max().item()
        assert err <= 2 * err_plain + 1e-3, f"{name}: {err:.3g} against plain bf16 math's {err_plain:.3g}"


# selected queries: scattered, in runs longer than a block (the loss's tokens of a multi-turn
# trajectory), the first and the last
ROWS = [[0, 3, 4, 5, 60, 61, 62, 63, 64, 65, 100], [*range(10, 90), *range(120, 129)], [129]]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("offset", [0, 41, None])
def test_selected_queries_equal_those_rows_of_the_whole_sequence(rows, offset):
    """``rows_N`` computes only those queries (over every key they may see): the same output rows, and
    the same gradients as the whole sequence's output taken at those rows (0 for the other queries)."""
    L = 130
    S = L + (offset or 0)
    q, k, v = qkv(2, L, S, 8, torch.float64, seed=4)
    rows_N = torch.tensor(rows)
    do = torch.randn(2, len(rows), 8, dtype=torch.float64)
    got = attend(q, k, v, offset=offset, scale=0.3, rows_N=rows_N)
    want = math_attention(q, k, v, offset, 0.3, rows)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), do), torch.autograd.grad(want, (q, k, v), do)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    pos = None if offset is None else rows_N + offset
    sel = q.detach()[:, rows].requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v: BlockedAttention.apply(q, k, v, pos, 0.3), (sel, k, v), fast_mode=True
    )


def test_selected_queries_beyond_the_limit_run_the_flash_kernel(monkeypatch):
    q, k, v = qkv(2, 40, 60, 16, torch.float32, seed=3)
    rows = [1, 2, 17, 39]
    monkeypatch.setattr(cpu_attention, "DENSE_MAX_SCORES", 0)
    for offset in (20, None):
        got = attend(q, k, v, offset=offset, scale=0.25, rows_N=torch.tensor(rows))
        torch.testing.assert_close(got, math_attention(q, k, v, offset, 0.25, rows), rtol=1e-5, atol=1e-5)


def test_large_score_matrices_run_the_flash_kernel(monkeypatch):
    """Above DENSE_MAX_SCORES the probabilities are not kept: SDPA runs, with the same result."""
    q, k, v = qkv(2, 40, 60, 16, torch.float32, seed=3)
    small = attend(q, k, v, offset=20, scale=0.25)
    calls = []
    monkeypatch.setattr(cpu_attention, "DENSE_MAX_SCORES", 2 * 20 * 20 - 1)
    monkeypatch.setattr(BlockedAttention, "apply", lambda *a: calls.append(a))
    for offset in (20, None):
        large = attend(q, k, v, offset=offset, scale=0.25)
        torch.testing.assert_close(large, math_attention(q, k, v, offset, 0.25), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(small, math_attention(q, k, v, 20, 0.25), rtol=1e-5, atol=1e-5)
    causal = attend(q[:, :20], k[:, :20], v[:, :20], offset=0, scale=0.25)
    torch.testing.assert_close(causal, math_attention(q[:, :20], k[:, :20], v[:, :20], 0, 0.25), rtol=1e-5, atol=1e-5)
    assert calls == []


def test_a_sequence_without_queries_attends_to_nothing():
    q, k, v = qkv(2, 0, 5, 8, torch.float32)
    for offset in (5, None):
        out = attend(q, k, v, offset=offset, scale=1.0)
        assert out.shape == (2, 0, 8)
    q, k, v = qkv(2, 5, 5, 8, torch.float32)
    out = attend(q, k, v, offset=0, scale=1.0, rows_N=torch.tensor([], dtype=torch.long))
    assert out.shape == (2, 0, 8)


def test_an_offset_that_does_not_put_the_extra_keys_in_front_is_refused():
    q, k, v = qkv(1, 4, 6, 8, torch.float32)
    with pytest.raises(ValueError, match=r"S - L = 2"):
        attend(q, k, v, offset=1, scale=1.0)


def test_the_kernel_benchmark_times_both_paths_and_restores_the_limit():
    from nemo_orchestra.kernels.bench import bench_shared_prompt

    limit = cpu_attention.DENSE_MAX_SCORES
    rows = bench_shared_prompt(prompt=16, continuations=(8, 5), heads=2, head_dim=8)
    assert [(r["dtype"], r["impl"]) for r in rows] == [
        ("float32", "blocked"),
        ("float32", "sdpa_flash"),
        ("bfloat16", "blocked"),
        ("bfloat16", "sdpa_flash"),
    ]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)
    assert cpu_attention.DENSE_MAX_SCORES == limit


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_packed_references_with_rows_equal_the_whole_pack_at_those_rows(shared_prompt):
    """``varlen_attention_ref`` and ``prefix_attention_ref`` with ``rows_N``: outputs (and lse) of the
    whole pack at those rows, gradients of the whole pack's output taken at those rows; sequences
    without a selected row, and the prompt's, are skipped."""
    from nemo_orchestra.kernels.reference import prefix_attention_ref, varlen_attention_ref

    lens, prefix = [30, 70, 9, 140], [-1, 0, 0, -1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens), 4, 8, generator=g).requires_grad_()
    k, v = (torch.randn(sum(lens), 2, 8, generator=g).requires_grad_() for _ in range(2))
    # none in the prompt or in sequence 2; runs inside 1 and 3, the last token
    rows = torch.tensor([31, 32, 33, 60, 99, 112, 113, *range(150, 230), 248])
    do = torch.randn(len(rows), 4, 8, generator=g)
    if shared_prompt:
        whole = prefix_attention_ref(q, k, v, cu, prefix)
        got = prefix_attention_ref(q, k, v, cu, prefix, rows_N=rows)
    else:
        whole, lse = varlen_attention_ref(q, k, v, cu, max(lens))
        got, got_lse = varlen_attention_ref(q, k, v, cu, max(lens), rows_N=rows)
        torch.testing.assert_close(got_lse, lse[:, rows])
    torch.testing.assert_close(got, whole[rows], rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), do), torch.autograd.grad(whole[rows], (q, k, v), do)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    empty = torch.tensor([], dtype=torch.long)
    if shared_prompt:
        assert prefix_attention_ref(q, k, v, cu, prefix, rows_N=empty).shape == (0, 4, 8)
    else:
        assert varlen_attention_ref(q, k, v, cu, max(lens), rows_N=empty)[0].shape == (0, 4, 8)
