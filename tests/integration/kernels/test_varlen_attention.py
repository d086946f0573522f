"""Varlen attention: Triton kernel vs the PyTorch reference vs a naive fp32 dense-mask attention.

On CPU the kernel runs under TRITON_INTERPRET=1 (see conftest.py), so sizes stay tiny. Low
precision is judged by flash-attention's rule: err(kernel) <= 2 * err(same-precision PyTorch) +
floor, both errors against fp32 attention of the same (rounded) inputs.
"""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from nemo_orchestra import kernels
from nemo_orchestra.kernels.reference import varlen_attention_ref
from nemo_orchestra.kernels.varlen_attention import varlen_bwd, varlen_fwd

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 is exact under the interpreter; on GPU the kernel's fp32 dots run in tf32.
FP32_ATOL = 2e-2 if DEVICE == "cuda" else 2e-5
FLOOR = {torch.float16: 1e-4, torch.bfloat16: 1e-3}


def ragged_cu_seqlens(seed, max_len=70, max_batch=4):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(2, max_batch + 1, (1,), generator=g))
    lens = torch.randint(1, max_len + 1, (B,), generator=g)
    return torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32), int(lens.max())


def cu_from_lengths(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def make_inputs(cu, Hq, Hkv, D, dtype, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, H, D, generator=g).to(dtype) for H in (Hq, Hkv, Hkv))
    dout = torch.randn(T, Hq, D, generator=g).to(dtype)
    dlse = torch.randn(Hq, T, generator=g)
    return q, k, v, dout, dlse


def naive_attention(q, k, v, cu, causal, scale):
    """fp32 dense attention over all T tokens with a block-diagonal (and causal) mask."""
    T, Hq, D = q.shape
    dev, cu = q.device, cu.to(q.device)
    seg = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=dev), (cu[1:] - cu[:-1]).long())
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed &= torch.arange(T, device=dev)[None, :] <= torch.arange(T, device=dev)[:, None]
    kv_head = torch.arange(Hq, device=dev) // (Hq // k.shape[1])
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()[:, kv_head]) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v.float()[:, kv_head])
    return out, scores.logsumexp(-1)


def outputs_and_grads(fn, q, k, v, dout, dlse):
    """(out, lse, dq, dk, dv) of fn, with the loss sum(out * dout) + sum(lse * dlse)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v)
    grads = torch.autograd.grad((out.float() * dout.float()).sum() + (lse * dlse).sum(), (q, k, v))
    return [out.detach(), lse.detach(), *grads]


def to_device(*xs):
    return [x.to(DEVICE) for x in xs]


CASES = [  # dtype, causal, Hq, Hkv, D
    (torch.float32, True, 2, 2, 64),
    (torch.float32, True, 4, 1, 64),
    (torch.float32, False, 4, 2, 64),
    (torch.float32, True, 4, 2, 128),
    (torch.float32, True, 2, 1, 48),  # head dim below its power-of-two block: masked lanes
    (torch.float16, True, 4, 2, 64),
    (torch.float16, False, 2, 1, 64),
    (torch.bfloat16, True, 4, 2, 64),
    (torch.bfloat16, False, 2, 2, 64),
    (torch.bfloat16, True, 2, 1, 128),
]


@pytest.mark.parametrize("seed", [0, 1], ids=lambda s: f"seed{s}")
@pytest.mark.parametrize(
    "dtype,causal,Hq,Hkv,D",
    CASES,
    ids=[f"{str(c[0])[6:]}-{'causal' if c[1] else 'full'}-h{c[2]}kv{c[3]}-d{c[4]}" for c in CASES],
)
def test_kernel_matches_naive_and_reference(dtype, causal, Hq, Hkv, D, seed):
    cu, max_len = ragged_cu_seqlens(seed)
    q, k, v, dout, dlse = to_device(*make_inputs(cu, Hq, Hkv, D, dtype, seed))
    cu = cu.to(DEVICE)
    scale = D**-0.5

    def kernel(q, k, v):
        return kernels.varlen_attention(q, k, v, cu, max_len, causal=causal)

    def reference(q, k, v):
        return varlen_attention_ref(q, k, v, cu, max_len, causal=causal)

    def naive(q, k, v):
        return naive_attention(q, k, v, cu, causal, scale)

    got = outputs_and_grads(kernel, q, k, v, dout, dlse)
    exact = outputs_and_grads(naive, q.float(), k.float(), v.float(), dout.float(), dlse)
    assert got[1].dtype == torch.float32 and got[0].dtype == dtype
    names = ["out", "lse", "dq", "dk", "dv"]
    if dtype == torch.float32:
        ref = outputs_and_grads(reference, q, k, v, dout, dlse)
        for name, a, b, c in zip(names, got, ref, exact):
            torch.testing.assert_close(a, c, atol=FP32_ATOL, rtol=FP32_ATOL, msg=f"{name} vs naive")
            torch.testing.assert_close(a, b, atol=FP32_ATOL, rtol=FP32_ATOL, msg=f"{name} vs reference")
        return
    same_precision = outputs_and_grads(reference, q, k, v, dout, dlse)
    for name, a, b, c in zip(names, got, same_precision, exact):
        err_kernel = (a.float() - c).abs().max().item()
        err_torch = (b.float() - c).abs().max().item()
        assert err_kernel <= 2 * err_torch + FLOOR[dtype], f"{name}: kernel {err_kernel:.3g} vs torch {err_torch:.3g}"


@pytest.mark.parametrize(
    "lengths",
    [[1], [1, 1, 1], [16, 32], [17, 3, 33], [5, 0, 7, 0], [0, 9], [70]],
    ids=lambda lens: "len" + "_".join(map(str, lens)),
)
def test_edge_lengths(lengths):
    """Length-1 sequences, block multiples, lengths that do not fill a block, empty sequences."""
    cu = cu_from_lengths(lengths)
    q, k, v, dout, dlse = to_device(*make_inputs(cu, 2, 1, 32, torch.float32, seed=len(lengths)))
    cu = cu.to(DEVICE)
    got = outputs_and_grads(lambda q, k, v: kernels.varlen_attention(q, k, v, cu, max(lengths)), q, k, v, dout, dlse)
    exact = outputs_and_grads(lambda q, k, v: naive_attention(q, k, v, cu, True, 32**-0.5), q, k, v, dout, dlse)
    for a, b in zip(got, exact):
        torch.testing.assert_close(a, b, atol=FP32_ATOL, rtol=FP32_ATOL)


@pytest.mark.parametrize("cu", [[0], [0, 0], [0, 0, 0]], ids=["B0", "B1-len0", "B2-len0"])
def test_empty_batch(cu):
    cu = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    q = torch.randn(0, 4, 64, device=DEVICE, requires_grad=True)
    k = torch.randn(0, 2, 64, device=DEVICE, requires_grad=True)
    v = torch.randn(0, 2, 64, device=DEVICE, requires_grad=True)
    out, lse = kernels.varlen_attention(q, k, v, cu, 0)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)
    dq, dk, dv = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v), allow_unused=True)
    assert all(g is None or g.numel() == 0 for g in (dq, dk, dv))


def poisoned_view(shape, pad, value=float("nan"), dtype=torch.float32):
    """A view of shape ``shape`` inside a buffer padded by ``pad`` on every side of every dim."""
    buf = torch.full([n + 2 * pad for n in shape], value, dtype=dtype, device=DEVICE)
    return buf, buf[tuple(slice(pad, pad + n) for n in shape)]


def margins_untouched(buf, shape, pad):
    inner = torch.zeros_like(buf, dtype=torch.bool)
    inner[tuple(slice(pad, pad + n) for n in shape)] = True
    return bool(torch.isnan(buf[~inner]).all())


@pytest.mark.parametrize("D", [32, 48])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_poisoned_memory(causal, D):
    """Inputs padded with NaN beyond their extent; outputs written into views of NaN buffers."""
    cu, max_len = cu_from_lengths([7, 20, 1]), 20
    T, Hq, Hkv, pad = int(cu[-1]), 4, 2, 3
    src = make_inputs(cu, Hq, Hkv, D, torch.float32, seed=7)
    cu = cu.to(DEVICE)
    q, k, v, dout = (poisoned_view(x.shape, pad)[1].copy_(x) for x in src[:4])
    dlse = poisoned_view(src[4].shape, pad)[1].copy_(src[4])
    out_buf, out = poisoned_view((T, Hq, D), pad)
    lse_buf, lse = poisoned_view((Hq, T), pad)
    varlen_fwd(q, k, v, cu, max_len, causal, D**-0.5, out=out, lse=lse)
    grads = [poisoned_view(x.shape, pad) for x in (q, k, v)]
    varlen_bwd(
        dout, q, k, v, out, lse, cu, max_len, causal, D**-0.5, dlse=dlse, dq=grads[0][1], dk=grads[1][1], dv=grads[2][1]
    )
    assert margins_untouched(out_buf, out.shape, pad) and margins_untouched(lse_buf, lse.shape, pad)
    for buf, view in grads:
        assert margins_untouched(buf, view.shape, pad)
    exact = outputs_and_grads(lambda q, k, v: naive_attention(q, k, v, cu, causal, D**-0.5), *to_device(*src))
    for a, b in zip([out, lse, grads[0][1], grads[1][1], grads[2][1]], exact):
        torch.testing.assert_close(a, b, atol=FP32_ATOL, rtol=FP32_ATOL)


def test_reference_matches_naive_and_skips_lse():
    cu, max_len = ragged_cu_seqlens(seed=5)
    q, k, v, dout, dlse = make_inputs(cu, 4, 2, 32, torch.float32, seed=5)
    ref = outputs_and_grads(lambda q, k, v: varlen_attention_ref(q, k, v, cu, max_len), q, k, v, dout, dlse)
    exact = outputs_and_grads(lambda q, k, v: naive_attention(q, k, v, cu, True, 32**-0.5), q, k, v, dout, dlse)
    for a, b in zip(ref, exact):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    out, lse = varlen_attention_ref(q, k, v, cu, max_len, return_lse=False, softmax_scale=0.3)
    assert lse is None
    torch.testing.assert_close(out, naive_attention(q, k, v, cu, True, 0.3)[0], atol=1e-5, rtol=1e-5)


def test_softmax_scale():
    cu, max_len = cu_from_lengths([9, 4]), 9
    q, k, v, _, _ = to_device(*make_inputs(cu, 2, 2, 32, torch.float32, seed=3))
    cu = cu.to(DEVICE)
    out, lse = kernels.varlen_attention(q, k, v, cu, max_len, softmax_scale=0.05)
    want_out, want_lse = naive_attention(q, k, v, cu, True, 0.05)
    torch.testing.assert_close(out, want_out, atol=FP32_ATOL, rtol=FP32_ATOL)
    torch.testing.assert_close(lse, want_lse, atol=FP32_ATOL, rtol=FP32_ATOL)


def _qkv(T=6, Hq=4, Hkv=2, D=32, dtype=torch.float32):
    return torch.randn(T, Hq, D, dtype=dtype), torch.randn(T, Hkv, D, dtype=dtype), torch.randn(T, Hkv, D, dtype=dtype)


BAD_INPUTS = {
    "q 2-D": (lambda q, k, v, cu: (q[0], k, v, cu, 6), "q must be [T, H, D]"),
    "int q": (lambda q, k, v, cu: (q.long(), k, v, cu, 6), "q must be one of"),
    "mixed dtypes": (lambda q, k, v, cu: (q.half(), k, v, cu, 6), "share a dtype"),
    "heads": (lambda q, k, v, cu: (q[:, :3], k, v, cu, 6), "multiple of key/value heads"),
    "k vs v": (lambda q, k, v, cu: (q, k, v[:, :1], cu, 6), "same shape"),
    "head dim": (lambda q, k, v, cu: (q, k[..., :16], v[..., :16], cu, 6), "like q"),
    "tokens": (lambda q, k, v, cu: (q, k[:5], v[:5], cu, 6), "like q"),
    "cu int64": (lambda q, k, v, cu: (q, k, v, cu.long(), 6), "int32"),
    "cu 2-D": (lambda q, k, v, cu: (q, k, v, cu[None], 6), "cu_seqlens must be [B+1]"),
    "cu start": (lambda q, k, v, cu: (q, k, v, cu + 1, 6), "start at 0 and end at T=6"),
    "cu end": (lambda q, k, v, cu: (q, k, v, cu[:-1], 6), "start at 0 and end at T=6"),
    "cu decreasing": (
        lambda q, k, v, cu: (q, k, v, torch.tensor([0, 4, 2, 6], dtype=torch.int32), 6),
        "non-decreasing",
    ),
    "max_seqlen": (lambda q, k, v, cu: (q, k, v, cu, 3), "max_seqlen=3 is smaller"),
    "cu list": (lambda q, k, v, cu: (q, k, v, [0, 2, 6], 6), "int32 tensor"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("op", ["kernel", "reference"])
def test_validation_errors(op, case):
    make_args, message = BAD_INPUTS[case]
    args = make_args(*_qkv(), torch.tensor([0, 2, 6], dtype=torch.int32))
    fn = kernels.varlen_attention if op == "kernel" else varlen_attention_ref
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(*args)


def test_head_dim_limit():
    q, k, v = (x.to(DEVICE) for x in _qkv(D=512))  # where the kernel runs: CUDA, or the interpreter on CPU
    with pytest.raises(ValueError, match="head dim must be <= 256"):
        kernels.varlen_attention(q, k, v, torch.tensor([0, 6], dtype=torch.int32, device=DEVICE), 6)


def test_cpu_without_interpreter_runs_reference_and_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from nemo_orchestra import kernels\n"
        "q = torch.randn(5, 2, 16, requires_grad=True)\n"
        "cu = torch.tensor([0, 2, 5], dtype=torch.int32)\n"
        "out, lse = kernels.varlen_attention(q, q, q, cu, 3)\n"
        "ref, _ = kernels.varlen_attention_ref(q, q, q, cu, 3)\n"
        "assert torch.equal(out, ref); out.sum().backward()\n"
        "a = kernels.grouped_advantage(torch.tensor([1., 0., 3.]), group_ids=torch.tensor([0, 0, 1]))\n"
        "assert abs(a[0] - 0.5 / (0.5**0.5 + 1e-6)) < 1e-6 and a[0] == -a[1] and a[2] == 0, a\n"
        "assert 'triton' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_op_stays_callable_after_direct_module_import():
    import nemo_orchestra.kernels.varlen_attention  # noqa: F401  (binds the module over the op on the package)

    cu = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 1, 16, device=DEVICE)
    out, _ = kernels.varlen_attention(q, q, q, cu, 3)
    torch.testing.assert_close(out, naive_attention(q, q, q, cu, True, 0.25)[0], atol=FP32_ATOL, rtol=FP32_ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_realistic_sizes(dtype):
    """A packed mix at training-like sizes against fp32 attention on the GPU."""
    lengths = [1, 200, 777, 1024, 2048, 3001, 129]
    cu = cu_from_lengths(lengths).cuda()
    q, k, v, dout, dlse = (x.cuda() for x in make_inputs(cu.cpu(), 16, 4, 128, dtype, seed=11))
    got = outputs_and_grads(lambda q, k, v: kernels.varlen_attention(q, k, v, cu, max(lengths)), q, k, v, dout, dlse)
    exact = outputs_and_grads(
        lambda q, k, v: varlen_attention_ref(q, k, v, cu, max(lengths)),
        q.float(),
        k.float(),
        v.float(),
        dout.float(),
        dlse,
    )
    if dtype == torch.float32:  # tf32 dots: looser
        for a, b in zip(got, exact):
            torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)
        return
    same = outputs_and_grads(lambda q, k, v: varlen_attention_ref(q, k, v, cu, max(lengths)), q, k, v, dout, dlse)
    for name, a, b, c in zip(["out", "lse", "dq", "dk", "dv"], got, same, exact):
        err_kernel, err_torch = (a.float() - c).abs().max().item(), (b.float() - c).abs().max().item()
        assert err_kernel <= 2 * err_torch + FLOOR[dtype], f"{name}: kernel {err_kernel:.3g} vs torch {err_torch:.3g}"
        assert math.isfinite(err_kernel)
