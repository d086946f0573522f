r"""Model FLOPs of the train stage, achieved TFLOP/s per GPU, MFU and peak memory.

Counted for a dense Qwen3/Llama decoder (a multiply-add is 2 FLOPs). L layers, hidden H, Hq
query heads and Hkv KV heads of size D, MLP width F (SwiGLU: gate, up, down), vocabulary V.
Matmul weights per token:

    N_mm = L (H (Hq + 2 Hkv) D + Hq D H + 3 H F) + V H          (QKV, output proj, MLP; LM head)

A forward pass over a pack of sequences of lengths s_i (T = sum s_i tokens) costs

    F = 2 N_mm T + L * 2 Hq D * sum_i s_i (s_i + 1)

the second term being causal attention: for the query at position j, QK^T and PV each take
2 Hq D (j + 1) FLOPs, and sum_{j<s} 2 (j + 1) = s (s + 1). A sequence that continues a shared
prompt of p tokens (``train/packing.py``) also attends to those: s (s + 1) + 2 s p. The count is
of the pack as computed: a shared prompt once. Where the last layer runs past its QKV projection on
the loss's rows only (``megatron.forward.last_layer_at``), its output projection, MLP and attention
count those rows: a query at position j of a sequence after p prompt tokens, 2 (j + 1 + p) pairs.
Backward costs twice the forward, so
a training step is 3F (= 6 N_mm T + 6 L Hq D sum s_i^2 + ..., the usual 6N rule plus attention),
and each forward-only pass (old logprobs, reference logprobs) is F. Not counted: embedding
lookups, norms, softmax, RoPE (well under 1%), and padding tokens. No activation recomputation.

    perf/tflops_per_gpu = FLOPs of the stage / (stage seconds x GPUs) / 1e12
    perf/mfu            = perf/tflops_per_gpu / peak

Peak: ``perf.peak_tflops`` or the dense bf16 figure of the device below (FP8 runs are still
compared to the bf16 peak). On a CPU there is no peak and no ``perf/mfu``.
"""

from __future__ import annotations

import resource

import torch

from nemo_orchestra.config import ModelConfig

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
}


def matmul_params(model: ModelConfig, vocab_size: int) -> int:
    H, D, F = model.hidden_size, model.head_dim, model.ffn_hidden_size
    hq, hkv = model.num_attention_heads, model.num_query_groups
    per_layer = H * (hq + 2 * hkv) * D + hq * D * H + 3 * H * F
    return model.num_layers * per_layer + vocab_size * H


def forward_flops(
    model: ModelConfig,
    vocab_size: int,
    seq_lens: list[int],
    logit_tokens: int | None = None,
    prefix_lens: list[int] | None = None,
    last_layer_rows: list[list[int]] | None = None,
) -> float:
    """FLOPs of one forward pass over sequences of these lengths (packed or not: the same), the output
    layer over ``logit_tokens`` of them (all by default; the trainer's passes compute logits only
    for the loss's tokens, ``megatron.forward.logits_at``); ``prefix_lens[i]``: the shared prompt's
    tokens that sequence i also attends to (0 by default). ``last_layer_rows[i]``: the positions in
    sequence i of the rows the last layer computes past its QKV projection (``last_layer_at``); the
    output layer then takes those rows, whatever ``logit_tokens`` says."""
    tokens = sum(seq_lens)
    logit_tokens = tokens if logit_tokens is None else logit_tokens
    prefix_lens = prefix_lens or [0] * len(seq_lens)
    pairs = sum(s * (s + 1) + 2 * s * p for s, p in zip(seq_lens, prefix_lens, strict=True))
    per_pair = 2 * model.num_attention_heads * model.head_dim
    H, D, F = model.hidden_size, model.head_dim, model.ffn_hidden_size
    body = matmul_params(model, vocab_size) - vocab_size * H
    flops = 2.0 * body * tokens + model.num_layers * per_pair * pairs
    if last_layer_rows is not None:
        logit_tokens = sum(len(r) for r in last_layer_rows)
        past_qkv = model.num_attention_heads * D * H + 3 * H * F  # output projection and MLP, per row
        last_pairs = sum(2 * (j + 1 + p) for r, p in zip(last_layer_rows, prefix_lens, strict=True) for j in r)
        flops -= 2.0 * past_qkv * (tokens - logit_tokens) + per_pair * (pairs - last_pairs)
    return flops + 2.0 * vocab_size * H * logit_tokens


def sequence_lengths(batches) -> tuple[list[int], list[int]]:
    """Lengths of the real (non-padding) sequences in packed batches, shared prompts included, and the
    length of the shared prompt each one continues (0: none)."""
    lens, prefixes, _ = sequence_layout(batches)
    return lens, prefixes


def sequence_layout(batches) -> tuple[list[int], list[int], list[list[int]]]:
    """``sequence_lengths`` and, per sequence, the positions (from its start) of its loss rows."""
    from nemo_orchestra.kernels.reference import rows_per_sequence
    from nemo_orchestra.train.packing import PADDING

    lens, prefixes, rows = [], [], []
    for b in batches:
        cu = b.cu_seqlens_B1.tolist()
        seg = [e - s for s, e in zip(cu[:-1], cu[1:])]
        of = b.prefix_B or [-1] * len(seg)
        per_sequence = rows_per_sequence(torch.nonzero(b.loss_mask_T > 0)[:, 0], cu)
        for n, j, p, r in zip(seg, b.traj_index_B, of, per_sequence):
            if j != PADDING:
                lens.append(n)
                prefixes.append(seg[p] if p >= 0 else 0)
                rows.append(r.tolist())
    return lens, prefixes, rows


def peak_tflops(configured: float | None) -> float | None:
    if configured:
        return configured
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def cpu_half_precision_flags(path: str = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's flags for native bf16/fp16 matmuls (AVX512-BF16, AVX512-FP16, AMX); ``None`` where
    the flags cannot be read (not Linux)."""
    try:
        with open(path) as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return None
    return set(line.split(":", 1)[-1].split()) & {"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"}


def slow_half_precision_warning(params_dtype: str, device: torch.device, path: str = "/proc/cpuinfo") -> str | None:
    """A one-line warning when ``model.params_dtype`` is bf16 or fp16 on a CPU that has no native
    instructions for it: torch then converts every matmul, which can be hundreds of times slower
    than fp32 (docs/performance.md)."""
    if device.type != "cpu" or params_dtype == "fp32":
        return None
    flags = cpu_half_precision_flags(path)
    wanted = {"bf16": {"avx512_bf16", "amx_bf16"}, "fp16": {"avx512_fp16", "amx_fp16"}}[params_dtype]
    if flags is None or flags & wanted:
        return None
    return (
        f"model.params_dtype={params_dtype} on a CPU without {' or '.join(sorted(wanted))}: its matmuls run "
        f"emulated, far slower than fp32; use model.params_dtype=fp32 on this machine"
    )


def peak_memory_gb() -> float:
    """Peak device memory allocated by torch (CUDA), else the process's peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def perf_metrics(flops: float, seconds: float, gpus: int, configured_peak: float | None) -> dict[str, float]:
    tflops = flops / max(seconds, 1e-9) / max(gpus, 1) / 1e12
    out = {"perf/tflops_per_gpu": tflops, "perf/peak_mem_gb": peak_memory_gb()}
    peak = peak_tflops(configured_peak)
    if peak:
        out["perf/mfu"] = tflops / peak
    return out
