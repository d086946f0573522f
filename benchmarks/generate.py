"""``python recipes/benchmark.py generate``: generated tokens/s of the in-process engines on the same prompts.

The GRPO step's generation as one engine call sees it: ``--prompts`` sequences (default 128, 16
prompts x 8 rollouts) of ``--prompt-tokens`` tokens on average (default 390, lengths uniform within
half of it either way: ~50,000 prompt tokens, as the 8-layer Qwen3-8B step has), each sampling
``--new-tokens`` tokens (default 144) at ``rollout.temperature`` and ``rollout.top_p`` with a seed of
its own, as rollouts do. No stop token: every engine decodes the same steps. The model is the
config's (``key=value`` as for the recipe: the tiny default, or ``model=qwen3_8b model.num_layers=8
model.params_dtype=bf16``) with its random initial weights; every engine gets the same ones.

Per engine (``--engines``, default ``hf,megatron``; ``megatron_copy`` generates as ``megatron``; a name
followed by ``:eager`` runs with ``rollout.cuda_graphs=false``): ``--warmup`` unmeasured calls (compiles,
allocator, caches, CUDA graph captures), then ``--calls`` measured ones, and as many calls generating one
token each, the prefill's time. Reported: ``generate_s`` and ``generated_tokens_per_s`` of the whole call,
``prefill_s``, ``decode_tokens_per_s``, the tokens after each sequence's first over the rest of the call,
``same_tokens``: the share of sequences of the first measured call whose tokens are the first engine's
(same seeds; engines that compute the same logits to the rounding agree on most), and ``graphs_captured``
(``graphs_captured_measured``, ``capture_s``): the decode shapes the engine captured as CUDA graphs, all told
and in the measured calls (none: the warm-up met every shape), and the seconds the captures took. With
``--profile``, the engines it names make one more call under ``torch.profiler``: ``profile`` has the ops that
took the most device time (CPU time on a CPU) and ``busy_share``, their time over the call's (well below 1 on
a GPU: the device waited for the host).

``bound``: what the device allows on this workload, from rates measured here in the run's
precision: the prefill's FLOPs (2 x the layers' parameters per prompt token, the causal attention's
2 x 2 x layers x query width x L^2 / 2 per prompt, and the output layer once per prompt) over the
best of repeated square matmuls, plus, per decode step, the bytes it must read (the layers' and the
output layer's weights once, and every sequence's keys and values so far) over the best of repeated
device-to-device copies. ``share_of_bound`` is bound over the measured call.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

ENGINES = ("hf", "megatron", "megatron_copy")
DEFAULT_ENGINES = "hf,megatron"  # megatron_copy generates as megatron does (its own copy of the same weights)
RUNS_AHEAD_AS = {"megatron": "megatron_copy"}  # an engine reading the live weights -> the same on a copy of its own
EAGER = ":eager"  # after an engine's name: rollout.cuda_graphs=false


def engine_args(spec: str, ahead: bool = False) -> list[str]:
    """The config overrides that run engine ``spec`` (``name`` or ``name:eager``); ``ahead``: the same
    engine on weights of its own where it reads the policy's (it can then run ahead of training)."""
    name, eager = spec.removesuffix(EAGER), spec.endswith(EAGER)
    if ahead:
        name = RUNS_AHEAD_AS.get(name, name)
    return [f"rollout.engine={name}", f"rollout.cuda_graphs={'false' if eager else 'true'}"]


def add_args(parser: Any) -> None:
    parser.add_argument("--engines", default=DEFAULT_ENGINES, help="comma-separated in-process engines")
    parser.add_argument("--prompts", type=int, default=128, help="sequences per generate call")
    parser.add_argument("--prompt-tokens", type=int, default=390, help="mean prompt length in tokens")
    parser.add_argument("--new-tokens", type=int, default=144, help="tokens each sequence generates")
    parser.add_argument("--calls", type=int, default=2, help="measured generate calls per engine")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured generate calls per engine first")
    parser.add_argument(
        "--profile",
        default="",
        help="comma-separated engines (as in --engines) whose one more call runs under torch.profiler: the ops "
        "that took the most device time (CPU time on a CPU) and the device's busy share of the call",
    )
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value, as for the recipe")


def make_prompts(n: int, mean_tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of random ids in [2, vocab), lengths uniform in [mean/2, 3*mean/2] (at least 1)."""
    rng = random.Random(seed)
    low, high = max(1, mean_tokens // 2), max(1, mean_tokens + mean_tokens // 2)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def workload(gpt, prompt_lengths: list[int], new_tokens: int, bytes_per_param: int) -> dict[str, float]:
    """The prefill's FLOPs and the bytes all decode steps read, for ``gpt`` (a Megatron GPTModel) on
    prompts of ``prompt_lengths`` generating ``new_tokens`` each (see the module's docstring)."""
    cfg = gpt.config
    layer_params = sum(p.numel() for p in gpt.decoder.parameters())
    output_params = (
        gpt.output_layer.weight.numel()
        if gpt.output_layer.weight is not None
        else gpt.embedding.word_embeddings.weight.numel()
    )
    q_width = cfg.num_attention_heads * cfg.kv_channels
    kv_width = (cfg.num_query_groups or cfg.num_attention_heads) * cfg.kv_channels
    tokens = sum(prompt_lengths)
    prefill_flops = (
        2 * layer_params * tokens
        + 2 * 2 * cfg.num_layers * q_width * sum(n * n / 2 for n in prompt_lengths)
        + 2 * output_params * len(prompt_lengths)
    )
    weight_bytes = (layer_params + output_params) * bytes_per_param
    kv_per_token = 2 * cfg.num_layers * kv_width * bytes_per_param  # keys and values, every layer
    # decode step j (1..new_tokens-1) reads every sequence's cache up to its prompt + j tokens
    kv_bytes = sum(kv_per_token * (n + j) for n in prompt_lengths for j in range(1, new_tokens))
    return {
        "prefill_flops": float(prefill_flops),
        "decode_steps": new_tokens - 1,
        "decode_bytes": float(weight_bytes * (new_tokens - 1) + kv_bytes),
    }


def device_rates(device, params_dtype: str, seconds: float = 1.0) -> dict[str, float]:
    """Matmul TFLOP/s (the best square product in the run's precision) and copy GB/s (the best
    device-to-device copy, read + write)."""
    import torch

    from benchmarks.grpo import best_seconds, matmul_peak_tflops

    cuda = device.type == "cuda"
    tflops = matmul_peak_tflops(params_dtype, 8192 if cuda else 2048, seconds, device)
    src = torch.ones((1 << 30 if cuda else 1 << 26) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src), seconds, device)
    return {"matmul_tflops": tflops, "copy_gbs": 2 * src.numel() * src.element_size() / copy_s / 1e9}


def time_calls(engine, prompts, new_tokens, temperature, top_p, warmup, calls, sync) -> dict[str, float]:
    """Mean wall time of ``calls`` generate calls (after ``warmup``) of ``new_tokens`` and of 1 token; the
    tokens of the first measured call (``tokens``, one list per sequence)."""

    def call(n: int, k: int) -> tuple[float, list[list[int]]]:
        seeds = [k * len(prompts) + i for i in range(len(prompts))]
        sync()
        t0 = time.perf_counter()
        gens = engine.generate(prompts, n, temperature, top_p, [], seeds=seeds)
        sync()
        return time.perf_counter() - t0, [g.token_ids for g in gens]

    for k in range(warmup):
        call(new_tokens, k)
    warm = graphs_captured(engine)
    full = [call(new_tokens, warmup + k) for k in range(calls)]
    first = [call(1, warmup + calls + k)[0] for k in range(calls)]
    captured = graphs_captured(engine)
    generate_s, tokens = statistics.fmean(t for t, _ in full), sum(len(t) for t in full[-1][1])
    prefill_s = statistics.fmean(first)
    decode = tokens - len(prompts)
    return {
        "generate_s": generate_s,
        "generated_tokens": tokens,
        "generated_tokens_per_s": tokens / generate_s,
        "prefill_s": prefill_s,
        "decode_tokens_per_s": decode / (generate_s - prefill_s) if generate_s > prefill_s else float("nan"),
        # decode shapes captured as CUDA graphs (engines that capture them), all told and in the measured calls
        "graphs_captured": captured[0],
        "graphs_captured_measured": captured[0] - warm[0],
        "capture_s": captured[1],
        "tokens": full[0][1],
    }


def profile_call(engine, prompts, new_tokens, temperature, top_p, device, sync, top: int = 12) -> dict[str, Any]:
    """One more generate call of ``new_tokens`` under ``torch.profiler``: its wall time, the device time of
    its ops (self time summed; on a CPU their CPU time) and that over the wall time (``busy_share``: well
    below 1 on a GPU, the device waits for the host), and the ``top`` ops by that time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    seeds = list(range(len(prompts)))
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, new_tokens, temperature, top_p, [], seeds=seeds)
        sync()
        wall_s = time.perf_counter() - t0

    # on a GPU the kernels (and copies) as the device ran them: an op's own device time is its kernels' again;
    # on a CPU every op's own CPU time (an op's children are not its own)
    events = prof.key_averages()
    if cuda:
        ops = [(e.key, e.count, e.self_device_time_total) for e in events if e.device_type == DeviceType.CUDA]
    else:
        ops = [(e.key, e.count, e.self_cpu_time_total) for e in events]
    busy_s = sum(us for _, _, us in ops) / 1e6
    ops.sort(key=lambda op: -op[2])
    return {
        "wall_s": wall_s,
        "device_s": busy_s,
        "busy_share": busy_s / wall_s,
        "top": [{"name": name, "calls": n, "self_ms": us / 1e3} for name, n, us in ops[:top] if us > 0],
    }


def measure_engine(engine, spec: str, profiled: bool, prompts, args: Any, rollout, device, sync) -> dict[str, Any]:
    """``time_calls`` for engine ``spec`` at ``rollout``'s sampling, and with ``profiled`` its profiled call
    (a profiler that fails loses the profile, not the engine's figures)."""
    sample = (rollout.temperature, rollout.top_p)
    r = time_calls(engine, prompts, args.new_tokens, *sample, args.warmup, args.calls, sync)
    if profiled:
        print(f"{spec}: one more call under torch.profiler", flush=True)
        try:
            r["profile"] = profile_call(engine, prompts, args.new_tokens, *sample, device, sync)
        except Exception as e:
            print(f"{spec}: the profiled call failed: {type(e).__name__}: {e}", flush=True)
            r["profile"] = {"error": f"{type(e).__name__}: {e}"}
    return r


def graphs_captured(engine) -> tuple[int, float]:
    """The decode shapes ``engine`` captured as CUDA graphs so far and the seconds that took (0 for an engine
    that captures none)."""
    return getattr(engine, "graphs_captured", 0), getattr(engine, "capture_s", 0.0)


def main(args: Any) -> int:
    from nemo_orchestra.config import ConfigError, load_config

    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e.removesuffix(EAGER) not in ENGINES]
    if unknown or not engines:
        print(
            f"error: --engines takes {', '.join(ENGINES)}, each may end in {EAGER} (got {args.engines!r})",
            file=sys.stderr,
        )
        return 2
    profiled = [e for e in args.profile.split(",") if e]
    if any(e not in engines for e in profiled):
        print(f"error: --profile takes engines of --engines ({args.engines}), got {args.profile!r}", file=sys.stderr)
        return 2
    if min(args.prompts, args.prompt_tokens, args.new_tokens, args.calls) < 1 or args.warmup < 0:
        print(
            "error: --prompts, --prompt-tokens, --new-tokens and --calls must be >= 1, --warmup >= 0", file=sys.stderr
        )
        return 2
    try:
        cfg = load_config(list(args.overrides))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if cfg.parallel.tp * cfg.parallel.pp > 1:
        print("error: the generate benchmark runs one process (parallel.tp=1, parallel.pp=1)", file=sys.stderr)
        return 2

    from nemo_orchestra.runtime.console import setup_logging

    setup_logging("WARNING", 0)
    import torch

    from nemo_orchestra.export.qwen3 import full_state_dict
    from nemo_orchestra.megatron.model import DTYPES, build_gpt_model, padded_vocab_size
    from nemo_orchestra.megatron.parallel import destroy_distributed, init_distributed
    from nemo_orchestra.rollout.engines import EngineContext, capabilities, start_engine

    info = init_distributed(cfg.parallel, cfg.run.seed)
    device = info.device
    vocab = cfg.model.vocab_size or padded_vocab_size(1024, 1)  # the tiny default's comes from its tokenizer: ~1k
    gpt = build_gpt_model(cfg.model, cfg.parallel, vocab, device)
    prompts = make_prompts(args.prompts, args.prompt_tokens, vocab, cfg.run.seed)
    dtype = DTYPES[cfg.model.params_dtype]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    tok = SimpleNamespace(get_vocab=dict, eos_token_id=1, pad_token_id=0)
    names = [e.removesuffix(EAGER) for e in engines]
    state = full_state_dict(gpt) if any(not capabilities(e).reads_policy_weights for e in names) else None
    rates = device_rates(device, cfg.model.params_dtype)
    load = workload(gpt, [len(p) for p in prompts], args.new_tokens, torch.finfo(dtype).bits // 8)
    prefill_bound = load["prefill_flops"] / (rates["matmul_tflops"] * 1e12)
    decode_bound = load["decode_bytes"] / (rates["copy_gbs"] * 1e9)
    bound = {**load, **rates, "prefill_s": prefill_bound, "decode_s": decode_bound}
    bound["generate_s"] = prefill_bound + decode_bound
    report = {
        "benchmark": "generate",
        "config": {
            "model": cfg.model.name,
            "num_layers": cfg.model.num_layers,
            "params_dtype": cfg.model.params_dtype,
            "prompts": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts),
            "new_tokens": args.new_tokens,
            "temperature": cfg.rollout.temperature,
            "top_p": cfg.rollout.top_p,
            "warmup_calls": args.warmup,
            "measured_calls": args.calls,
            "overrides": list(args.overrides),
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        },
        "engines": {},
        "bound": bound,
    }
    reference = None  # the first measured engine's tokens
    failed: list[str] = []
    for spec, name in zip(engines, names):
        print(f"{spec}: {args.warmup} warm-up and {args.calls} measured calls of {len(prompts)} sequences", flush=True)
        rollout = load_config([*args.overrides, *engine_args(spec)]).rollout
        ctx = EngineContext(
            cfg.model, vocab, tok, device, rollout=rollout, seed=cfg.run.seed, model=gpt, parallel=cfg.parallel
        )
        try:
            engine = start_engine(name, ctx, state)
            try:
                r = measure_engine(engine, spec, spec in profiled, prompts, args, cfg.rollout, device, sync)
            finally:
                engine.close()
                del engine
        except Exception as e:  # one engine's failure: the others are still measured, and the exit status says it
            print(f"{spec}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            report["engines"][spec] = {"error": f"{type(e).__name__}: {e}"}
            failed.append(spec)
            continue
        tokens = r.pop("tokens")
        reference = tokens if reference is None else reference
        r["share_of_bound"] = bound["generate_s"] / r["generate_s"]
        r["same_tokens"] = statistics.fmean(a == b for a, b in zip(tokens, reference))
        report["engines"][spec] = r
        # written after each engine, so that a run stopped by a time limit keeps what it measured
        measured = {e: r for e, r in report["engines"].items() if "error" not in r}
        fastest = max(measured, key=lambda e: measured[e]["generated_tokens_per_s"])
        report["fastest"], report["fastest_args"] = fastest, engine_args(fastest)
        # for rollouts ahead (rollout.steps_ahead > 0, an engine holding its own weights): the fastest, or
        # the same engine on a copy of its own where the fastest reads the live weights
        report["fastest_ahead_args"] = engine_args(fastest, ahead=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    destroy_distributed()
    print(table(report))
    if args.out:
        print(f"wrote {args.out}")
    if failed:
        print(f"error: {', '.join(failed)} failed (above); the others were measured", file=sys.stderr)
        return 1
    return 0


def table(report: dict) -> str:
    c, b = report["config"], report["bound"]
    rows = [
        f"generate: model={c['model']} ({c['num_layers']} layers, {c['params_dtype']}), device={report['machine']['device']}, "
        f"{c['prompts']} sequences, {c['prompt_tokens']} prompt tokens, {c['new_tokens']} new tokens each",
        f"{'engine':<20}{'call s':>9}{'tokens/s':>11}{'prefill s':>11}{'decode tok/s':>14}{'of bound':>10}"
        f"{'same tokens':>13}{'graphs':>8}",
    ]
    for name, r in report["engines"].items():
        if "error" in r:
            rows.append(f"{name:<20}failed: {r['error'].splitlines()[0][:100]}")
            continue
        rows.append(
            f"{name:<20}{r['generate_s']:>9.3f}{r['generated_tokens_per_s']:>11.0f}{r['prefill_s']:>11.3f}"
            f"{r['decode_tokens_per_s']:>14.0f}{r['share_of_bound']:>10.1%}{r['same_tokens']:>13.1%}"
            f"{r.get('graphs_captured', 0):>8}"
        )
    for name, r in report["engines"].items():
        if "profile" in r and "error" not in r["profile"]:
            prof = r["profile"]
            rows.append(
                f"{name} under the profiler: call {prof['wall_s']:.3f} s, ops {prof['device_s']:.3f} s "
                f"({prof['busy_share']:.0%} of the call); most time:"
            )
            rows += [f"  {op['self_ms']:>10.1f} ms {op['calls']:>7}x  {op['name'][:90]}" for op in prof["top"][:8]]
    rows.append(
        f"bound {b['generate_s']:.3f} s: prefill {b['prefill_flops'] / 1e12:.2f} TFLOP at {b['matmul_tflops']:.1f} TFLOP/s "
        f"({b['prefill_s']:.3f} s), {b['decode_steps']} decode steps reading {b['decode_bytes'] / 1e9:.1f} GB at "
        f"{b['copy_gbs']:.0f} GB/s ({b['decode_s']:.3f} s); fastest: {report.get('fastest', 'none')}, "
        f"ahead of training: {' '.join(report.get('fastest_ahead_args', ['none']))}"
    )
    return "\n".join(rows)
