"""Benchmark the kernels: prints a table and writes JSON.

    python -m nemo_orchestra.kernels.bench [--out FILE.json]      (default runs/kernel_bench.json)

On a GPU:
- varlen attention, forward and forward+backward TFLOP/s of the Triton kernel, of
  ``flash_attn_varlen_func`` (when flash-attn is installed) and of PyTorch SDPA called per sequence
  (the reference), on packed mixes of 16k tokens made of 200-8k-token trajectories,
  Hq=32, Hkv=8, D=128, bf16, causal. The Triton kernel is timed through its autograd Function,
  without the input checks (which read cu_seqlens back to the host).
  Causal FLOPs of a pack: fwd = 4 * Hq * D * sum_b L_b (L_b + 1) / 2 (two matmuls, 2 FLOPs per
  multiply-add, the lower triangle with its diagonal); bwd = 2.5 * fwd (five matmuls);
  fwd+bwd = 3.5 * fwd.
- grouped advantage at 1M rewards (groups of 16), GB/s = (rewards read + advantages written +
  offsets read) / time, against the HBM bandwidth measured by a 1 GiB device-to-device copy
  (2 bytes moved per byte copied).
On CPU: the references (the CPU training path) timed at small sizes, and a group's attention as CPU
training runs it with shared prompts (``nemo_orchestra.kernels.reference.prefix_attention_ref``: a 220-token prompt
and 8 continuations of 300 tokens, 4 heads, D=64, one thread, fp32 and bf16) by the blocked path
(``nemo_orchestra/kernels/cpu_attention.py``) and by PyTorch's CPU flash kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from nemo_orchestra import kernels
from nemo_orchestra.kernels import cpu_attention
from nemo_orchestra.kernels.reference import grouped_advantage_ref, prefix_attention_ref, varlen_attention_ref


def causal_flops_fwd(lengths, n_heads, head_dim):
    return 4 * n_heads * head_dim * sum(n * (n + 1) // 2 for n in lengths)


def packed_mix(seed, total=16384, lo=200, hi=8192):
    """Trajectory lengths, log-uniform in [lo, hi], filling exactly ``total`` tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        n = int(
            torch.exp(
                torch.empty(1).uniform_(
                    float(torch.log(torch.tensor(lo))), float(torch.log(torch.tensor(hi))), generator=g
                )
            )
        )
        lengths.append(min(n, total - sum(lengths)))
    if len(lengths) > 1 and lengths[-1] < lo:  # fold a short remainder into the previous trajectory
        lengths[-2] += lengths.pop()
    return lengths


def cu_seqlens(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def time_ms(fn, device, reps=20, warmup=3):
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def attention_impls(device):
    impls = {"sdpa_per_seq": lambda q, k, v, cu, m: varlen_attention_ref(q, k, v, cu, m, return_lse=False)[0]}
    if device != "cuda":
        return impls
    from nemo_orchestra.kernels.varlen_attention import VarlenAttentionFunction

    impls["triton"] = lambda q, k, v, cu, m: VarlenAttentionFunction.apply(q, k, v, cu, m, True, q.shape[-1] ** -0.5)[0]
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        print("flash-attn is not installed: skipping flash_attn_varlen_func")
    else:
        impls["flash_attn2"] = lambda q, k, v, cu, m: flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True)
    return impls


def bench_attention(device, mixes, n_heads, n_kv_heads, head_dim, dtype):
    rows = []
    for seed in mixes:
        lengths = packed_mix(seed) if device == "cuda" else [256, 100, 31, 125]
        T, cu, max_len = sum(lengths), cu_seqlens(lengths, device), max(lengths)
        q = torch.randn(T, n_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(T, n_kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in "kv")
        dout = torch.randn(T, n_heads, head_dim, device=device, dtype=dtype)
        flops = causal_flops_fwd(lengths, n_heads, head_dim)
        for name, fn in attention_impls(device).items():

            def fwd():
                with torch.no_grad():
                    fn(q, k, v, cu, max_len)

            def fwd_bwd():
                torch.autograd.grad(fn(q, k, v, cu, max_len), (q, k, v), dout)

            fwd_ms, fwd_bwd_ms = time_ms(fwd, device), time_ms(fwd_bwd, device)
            rows.append(
                {
                    "mix": seed,
                    "tokens": T,
                    "n_seqs": len(lengths),
                    "max_seqlen": max_len,
                    "impl": name,
                    "fwd_ms": fwd_ms,
                    "fwd_tflops": flops / fwd_ms / 1e9,
                    "fwd_bwd_ms": fwd_bwd_ms,
                    "fwd_bwd_tflops": 3.5 * flops / fwd_bwd_ms / 1e9,
                }
            )
    return rows


def bench_shared_prompt(prompt=220, continuations=(300,) * 8, heads=4, head_dim=64):
    """One group's attention with its prompt packed once, forward and forward + backward, on one thread:
    the blocked CPU path against SDPA's flash kernel (``DENSE_MAX_SCORES`` 0 sends every sequence there)."""
    lengths = [prompt, *continuations]
    cu = cu_seqlens(lengths, "cpu")
    prefix = [-1] + [0] * len(continuations)
    flops = (
        4 * heads * head_dim * (prompt * (prompt + 1) // 2 + sum(n * prompt + n * (n + 1) // 2 for n in continuations))
    )
    threads, limit, rows = torch.get_num_threads(), cpu_attention.DENSE_MAX_SCORES, []
    torch.set_num_threads(1)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(sum(lengths), heads, head_dim, dtype=dtype, requires_grad=True) for _ in "qkv")
            dout = torch.randn_like(q)
            for name, max_scores in (("blocked", limit), ("sdpa_flash", 0)):
                cpu_attention.DENSE_MAX_SCORES = max_scores

                def fwd():
                    with torch.no_grad():
                        prefix_attention_ref(q, k, v, cu, prefix)

                def fwd_bwd():
                    torch.autograd.grad(prefix_attention_ref(q, k, v, cu, prefix), (q, k, v), dout)

                fwd_ms, fwd_bwd_ms = time_ms(fwd, "cpu"), time_ms(fwd_bwd, "cpu")
                rows.append(
                    {
                        "dtype": str(dtype).removeprefix("torch."),
                        "impl": name,
                        "fwd_ms": fwd_ms,
                        "fwd_gflops": flops / fwd_ms / 1e6,
                        "fwd_bwd_ms": fwd_bwd_ms,
                        "fwd_bwd_gflops": 3.5 * flops / fwd_bwd_ms / 1e6,
                    }
                )
    finally:
        cpu_attention.DENSE_MAX_SCORES = limit
        torch.set_num_threads(threads)
    return rows


def hbm_copy_gbs():
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src), "cuda") / 1e6


def bench_advantage(device, n=2**20, group=16):
    G = n // group
    rewards = torch.rand(n, device=device)
    offsets = torch.arange(0, n + 1, group, device=device)
    ids = torch.arange(G, device=device).repeat_interleave(group)[torch.randperm(n, device=device)]
    bytes_moved = 2 * rewards.numel() * rewards.element_size() + offsets.numel() * offsets.element_size()
    cases = {
        "reference_offsets": lambda: grouped_advantage_ref(rewards, offsets=offsets, clip=3.0),
        "reference_ids": lambda: grouped_advantage_ref(rewards, group_ids=ids, clip=3.0),
    }
    if device == "cuda":
        from nemo_orchestra.kernels.grouped_advantage import grouped_advantage_launch

        cases["triton_kernel_offsets"] = lambda: grouped_advantage_launch(rewards, offsets, group, "std", 1e-6, 3.0)
        cases["triton_op_offsets"] = lambda: kernels.grouped_advantage(rewards, offsets=offsets, clip=3.0)
        cases["triton_op_ids"] = lambda: kernels.grouped_advantage(rewards, group_ids=ids, clip=3.0)
    rows = []
    for name, fn in cases.items():
        ms = time_ms(fn, device)
        rows.append({"impl": name, "n": n, "group": group, "ms": ms, "gbs": bytes_moved / ms / 1e6})
    return rows


def print_table(title, rows, cols):
    print(f"\n{title}")
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>14.3f}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m nemo_orchestra.kernels.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/kernel_bench.json", help="JSON file to write")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        attn = bench_attention(device, mixes=[0, 1, 2], n_heads=32, n_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
        shape = {"Hq": 32, "Hkv": 8, "D": 128, "dtype": "bfloat16", "tokens_per_pack": 16384}
    else:
        attn = bench_attention(device, mixes=[0], n_heads=8, n_kv_heads=2, head_dim=64, dtype=torch.float32)
        shape = {"Hq": 8, "Hkv": 2, "D": 64, "dtype": "float32", "lengths": [256, 100, 31, 125]}
    adv = bench_advantage(device, n=2**20 if device == "cuda" else 2**16)
    shared = bench_shared_prompt() if device == "cpu" else []
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "attention_shape": shape,
        "flops": "causal fwd = 4*Hq*D*sum_b L_b(L_b+1)/2; fwd+bwd = 3.5 * fwd",
        "attention": attn,
        "advantage": adv,
    }
    if shared:
        result["shared_prompt_attention"] = shared
    if device == "cuda":
        import triton

        result["triton"] = triton.__version__
        result["hbm_copy_gbs"] = hbm_copy_gbs()
        for r in adv:
            r["pct_of_hbm"] = 100 * r["gbs"] / result["hbm_copy_gbs"]
        print(f"HBM bandwidth (1 GiB device-to-device copy): {result['hbm_copy_gbs']:.0f} GB/s")
    print(f"device: {result['device']}  shape: {shape}")
    print_table(
        "varlen attention (causal)",
        attn,
        ["mix", "tokens", "n_seqs", "impl", "fwd_ms", "fwd_tflops", "fwd_bwd_ms", "fwd_bwd_tflops"],
    )
    if shared:
        print_table(
            "a group's attention, shared prompt (220 + 8 x 300 tokens, 4 heads, D=64, one thread)",
            shared,
            ["dtype", "impl", "fwd_ms", "fwd_gflops", "fwd_bwd_ms", "fwd_bwd_gflops"],
        )
    print_table("grouped advantage", adv, [c for c in ("impl", "n", "group", "ms", "gbs", "pct_of_hbm") if c in adv[0]])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
