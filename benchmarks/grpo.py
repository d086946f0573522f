"""``python recipes/benchmark.py grpo``: tokens/s of a GRPO step and where its time goes.

Builds the run the recipe would build from the same ``key=value`` overrides (the tiny default
on CPU; ``model=qwen3_8b`` and a real tokenizer on a GPU), runs ``--warmup`` unmeasured GRPO
steps, then ``--steps`` measured ones, and reports per step:

- ``generation_s``: the engine's generate calls (wall time, on the rollout's worker thread)
- ``environment_s``: the rest of the rollout: episode set-up, tool calls the engine waited
  for, and accounting (tool calls that overlap generation are not counted twice)
- ``reference_logprobs_s``: the frozen reference's forward pass over the packed batch; 0 when it
  runs on a thread of its own beside the update (``perf.overlap_reference``), whose time is then
  ``reference_ahead_s`` (the update's waits for it, ``reference_wait_s``, are in ``training_s``),
  at idle priority in a ``reference_idle_share`` of the steps (those whose trainer waited for its
  rollouts)
- ``training_s``: forward, backward and the optimizer step (the policy's old logprobs come from
  this forward: one optimizer step per batch of rollouts)
- ``weight_sync_s``: pushing the new weights into the generation engine
- ``rollout_wait_s``: the trainer's wait for the step's rollouts; with ``rollout.steps_ahead=K``
  they run while earlier steps train, so generation and environment time overlap training and
  only this wait is on the step's critical path (``rollout_wait_share`` of the step)
- ``tokens_per_s``: every token of the step's trajectories (prompts, generated turns,
  observations) over the step's wall time; ``generated_tokens_per_s`` over generation time.
- ``mfu``: model FLOPs of the logprob and training passes over their own time, and ``step_mfu``
  the same FLOPs over the whole step, against the machine's peak: on a CPU the matmul peak
  measured in the same run (a 2048 x 2048 matmul in the run's precision), on a GPU the device's
  dense bf16 peak (``perf.peak_tflops`` overrides both).

Steady state. With ``rollout.steps_ahead=K`` the first step starts the rollouts of steps 0..K at
once, and steps 1..K find theirs done or nearly: a head start no later step has. So the warm-up is
at least K + 1 steps, for every K (1 when synchronous): ``--warmup auto``, the default, is K + 1, and
a smaller ``--warmup`` is raised to K + 1 with a printed line. Once rollouts bound the step, the
rollouts of K + 1 consecutive steps run in step with each other and the step times repeat every K + 1
steps (one step waits, K do not), so ``--steps`` is rounded up to a multiple of K + 1, with a printed
line: any window of whole periods then reads the same.

The report's ``timeline`` has one entry per warm-up and measured step: its ``start_s`` and ``end_s``
(seconds since the first step began), the trainer's ``rollout_wait_s``, and when the step's rollouts
were started and finished (``rollouts_started_s``, ``rollouts_finished_s``, on the same clock; started
before the step when they ran ahead). ``engine_idle_share``: the share of the measured window (the first
measured step's start to the last one's end) in which no generate call of the engine was running;
``engine_calls_per_step`` and ``sequences_per_engine_call``: the engine's generate calls that started in
the window, per measured step, and their mean batch (whichever steps' rollouts made them). The megatron
engines on CUDA capture each decode shape as a CUDA graph when they first meet it: each timeline entry has
the shapes captured during its step (``graphs_captured``, ``capture_s``), and the summary those of the
measured steps (``graphs_captured_measured``, ``capture_s_measured``; a line says so when there were any).

The warm start is off unless asked for (``warm_start.steps=N``): an untrained policy writes whole
turns until ``rollout.max_new_tokens_per_turn``, the longest generation the config allows.
Groups whose rewards are all equal are kept (``advantage.min_group_std=-1``; the recipe drops
them) and so are rollouts with malformed calls (``advantage.drop_format_errors=false``; the recipe
masks them out of the loss, and an untrained policy writes nothing else), so every step trains on
its whole batch and the timings do not depend on luck. Rollouts sample at temperature 1, the
workload docs/performance.md compares with TRL's, with 8 copy lessons a step (``loss.copy_lessons_per_step=8``,
the workload every results file measured; the default run takes 32). With ``rollout.steps_ahead=K`` the run is K
steps longer than the steps it runs, so that every measured step has the next steps' rollouts
running beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any, Callable

from benchmarks.generate import graphs_captured as engine_graphs_captured

# on the trainer's critical path; generation and environment are the rollouts' own (they overlap
# training when rollouts run ahead)
PHASES = (
    ("rollout_wait_s", "time/rollout_wait_s"),
    ("reference_logprobs_s", "time/ref_logprobs_s"),
    ("training_s", "time/update_s"),
    ("weight_sync_s", "time/weight_sync_s"),
)
ROLLOUT_PHASES = (("generation_s", "time/generate_s"), ("environment_s", None))
BENCH_DEFAULTS = (
    "warm_start.steps=0",
    "evaluation.enabled=false",
    "export.enabled=false",
    "checkpoint.save_every=0",
    "advantage.min_group_std=-1.0",
    "advantage.drop_format_errors=false",
    "advantage.drop_unanswered=false",
    "rollout.temperature=1.0",
    "loss.copy_lessons_per_step=8",
)


def add_args(parser: Any) -> None:
    parser.add_argument(
        "--steps",
        type=int,
        default=3,
        help="measured GRPO steps, rounded up to a multiple of rollout.steps_ahead + 1",
    )
    parser.add_argument(
        "--warmup",
        type=warmup_arg,
        default="auto",
        help="unmeasured GRPO steps first: auto is rollout.steps_ahead + 1, the least taken",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="write the JSON report here (default: <run dir>/bench_grpo.json), and remove a temp run dir",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value, as for the recipe")


def warmup_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or a whole number of steps, not {text!r}") from None


def plan_steps(steps_ahead: int, warmup: int | str, steps: int) -> tuple[int, int, list[str]]:
    """(warm-up steps, measured steps, a line for each change made to the ones asked for): at least
    K + 1 warm-up steps, and a multiple of K + 1 measured (see the module's docstring)."""
    period, notes = steps_ahead + 1, []
    if warmup == "auto":
        warmup = period
    elif warmup < period:
        why = (
            f"the first step starts the rollouts of steps 0..{steps_ahead} together, and "
            + ("step 1 would find its" if steps_ahead == 1 else f"steps 1..{steps_ahead} would find theirs")
            + " done early"
            if steps_ahead
            else "the first step's one-time costs stay out of the measurement"
        )
        notes.append(f"--warmup {warmup} raised to {period} (rollout.steps_ahead + 1, the least): {why}")
        warmup = period
    if steps % period:
        rounded = -(-steps // period) * period
        notes.append(
            f"--steps {steps} rounded up to {rounded}: with rollout.steps_ahead={steps_ahead} the step times "
            f"repeat every {period} steps, so the measured steps are whole periods"
        )
        steps = rounded
    return warmup, steps, notes


def run_steps(
    trainer: Any, warmup: int, steps: int, log: Callable[[str], None] | None = None
) -> tuple[list[dict], dict[str, Any]]:
    """``warmup`` then ``steps`` GRPO steps of ``trainer`` (``grpo_step()``, then ``step += 1``); the measured
    steps' metrics, and ``{"timeline": [...], "engine_idle_share": ...}`` (see the module's docstring).
    ``trainer.generation.calls`` says when the engine's generate calls ran (``GenerateCalls``)."""
    clock = time.perf_counter
    measured: list[dict] = []
    timeline: list[dict] = []
    first = window_start = window_end = None
    for i in range(warmup + steps):
        captured = graphs_captured(trainer)
        start = clock()
        first = start if first is None else first
        m = trainer.grpo_step()
        end = clock()
        trainer.step += 1
        tag = "warmup" if i < warmup else "measured"
        new_graphs, capture_s = (b - a for a, b in zip(captured, graphs_captured(trainer)))
        timeline.append(
            {
                "step": i,
                "phase": tag,
                "start_s": start - first,
                "end_s": end - first,
                "rollout_wait_s": m.get("time/rollout_wait_s", 0.0),
                "rollouts_started_s": start - first + m.get("time/rollouts_started_s", 0.0),
                "rollouts_finished_s": start - first + m.get("time/rollouts_finished_s", 0.0),
                "graphs_captured": new_graphs,
                "capture_s": capture_s,
            }
        )
        if log is not None:
            log(
                f"step {i + 1}/{warmup + steps} ({tag}): {m['time/step_s']:.2f} s, "
                f"{m['perf/tokens_per_s']:.0f} tokens/s"
                + (f", {new_graphs} decode shapes captured as CUDA graphs ({capture_s:.2f} s)" if new_graphs else "")
            )
        if i >= warmup:
            window_start = start if window_start is None else window_start
            window_end = end
            measured.append(m)
    busy = trainer.generation.calls.busy_s(window_start, window_end)
    idle = float("nan") if busy is None else 1.0 - busy / (window_end - window_start)
    calls, sequences = trainer.generation.calls.started_in(window_start, window_end) or (0, 0)
    return measured, {
        "timeline": timeline,
        "graphs_captured_measured": sum(t["graphs_captured"] for t in timeline if t["phase"] == "measured"),
        "capture_s_measured": sum(t["capture_s"] for t in timeline if t["phase"] == "measured"),
        "engine_idle_share": idle,
        "engine_calls_per_step": calls / steps if calls else float("nan"),
        "sequences_per_engine_call": sequences / calls if calls else float("nan"),
    }


def graphs_captured(trainer: Any) -> tuple[int, float]:
    """``benchmarks.generate.graphs_captured`` of the trainer's generation engine (0 before it starts)."""
    return engine_graphs_captured(getattr(trainer.generation, "engine", None))


def summarize(steps: list[dict]) -> dict[str, float]:
    """Mean per-step figures from the trainer's metrics of the measured steps."""
    mean = statistics.fmean
    out: dict[str, float] = {}
    for name, key in PHASES + ROLLOUT_PHASES:
        if key is not None:
            out[name] = mean(m.get(key, 0.0) for m in steps)
    # the rollouts' own wall time (generation, and waiting on tools) minus generation
    out["environment_s"] = mean(
        m.get("time/rollouts_wall_s", m["time/rollout_s"]) - m.get("time/generate_s", 0.0) for m in steps
    )
    out["reference_ahead_s"] = mean(m.get("time/ref_logprobs_ahead_s", 0.0) for m in steps)
    out["reference_wait_s"] = mean(m.get("time/ref_logprobs_wait_s", 0.0) for m in steps)
    out["reference_idle_share"] = mean(m.get("perf/ref_logprobs_idle", 0.0) for m in steps)
    out["step_s"] = mean(m["time/step_s"] for m in steps)
    out["other_s"] = out["step_s"] - sum(out[name] for name, _ in PHASES)
    out["rollout_wait_share"] = out["rollout_wait_s"] / out["step_s"]
    out["tokens_per_step"] = mean(m["perf/tokens_per_s"] * m["time/step_s"] for m in steps)
    out["generated_tokens_per_step"] = mean(m["perf/generated_tokens"] for m in steps)
    out["tokens_per_s"] = out["tokens_per_step"] / out["step_s"]
    gen = out["generation_s"]
    out["generated_tokens_per_s"] = out["generated_tokens_per_step"] / gen if gen > 0 else float("nan")
    out["generate_calls_per_step"] = mean(m.get("rollout/generate_calls", 0) for m in steps)
    for key in ("perf/tflops_per_gpu", "perf/mfu", "perf/peak_mem_gb"):
        if all(key in m for m in steps):
            out[key.split("/", 1)[1]] = mean(m[key] for m in steps)
    if all("perf/mfu" in m for m in steps):  # the train stage's FLOPs over the whole step
        out["step_mfu"] = mean(m["perf/mfu"] * m["time/train_s"] / m["time/step_s"] for m in steps)
    return out


def table(summary: dict[str, float]) -> str:
    step = summary["step_s"]
    rows = [f"{'phase':<22}{'s/step':>10}{'share':>9}"]
    for name in [p for p, _ in PHASES] + ["other_s"]:
        rows.append(f"{name.removesuffix('_s'):<22}{summary[name]:>10.3f}{summary[name] / step:>9.1%}")
    rows.append(f"{'step':<22}{step:>10.3f}")
    rows.append(
        "rollouts ("
        + ", ".join(f"{name.removesuffix('_s')} {summary[name]:.3f} s" for name, _ in ROLLOUT_PHASES)
        + "): overlap training when rollout.steps_ahead > 0"
    )
    if summary.get("reference_ahead_s", 0.0) > 0:
        rows.append(
            f"reference logprobs beside the update: {summary['reference_ahead_s']:.3f} s on a thread of their own "
            f"(perf.overlap_reference), at idle priority in {summary['reference_idle_share']:.0%} of the steps; "
            f"the update waited {summary['reference_wait_s']:.3f} s for it"
        )
    rows.append(
        f"tokens/s {summary['tokens_per_s']:.0f} ({summary['tokens_per_step']:.0f} tokens/step); "
        f"generated tokens/s {summary['generated_tokens_per_s']:.0f} "
        f"({summary['generated_tokens_per_step']:.0f}/step in {summary['generate_calls_per_step']:.1f} "
        "calls of the step's rollouts)"
    )
    if "engine_idle_share" in summary:
        rows.append(
            f"rollout wait {summary['rollout_wait_share']:.1%} of the measured steps' time; engine idle (no "
            f"generate call running) {summary['engine_idle_share']:.1%} of the measured window"
        )
    if summary.get("engine_calls_per_step", 0) > 0:
        rows.append(
            f"the engine ran {summary['engine_calls_per_step']:.1f} generate calls a step, "
            f"{summary['sequences_per_engine_call']:.1f} sequences each"
        )
    if "mfu" in summary:
        rows.append(
            f"MFU {summary['mfu']:.1%} in the logprob and training passes, {summary['step_mfu']:.1%} over "
            f"the step ({summary['tflops_per_gpu'] * 1e3:.1f} GFLOP/s of a {summary['peak_tflops'] * 1e3:.0f} "
            "GFLOP/s peak)"
        )
    return "\n".join(rows)


def main(args: Any) -> int:
    from nemo_orchestra.config import ConfigError, load_config

    if args.steps < 1 or (args.warmup != "auto" and args.warmup < 0):
        print(f"error: --steps must be >= 1 and --warmup >= 0 (got {args.steps} and {args.warmup})", file=sys.stderr)
        return 2
    overrides, scratch = list(args.overrides), None
    if not any(o.startswith("run.output_dir=") for o in overrides):
        scratch = tempfile.mkdtemp(prefix="bench_grpo-")
        overrides.append(f"run.output_dir={scratch}")
    try:
        cfg = load_config([*BENCH_DEFAULTS, *overrides])
        warmup, steps, notes = plan_steps(cfg.rollout.steps_ahead, args.warmup, args.steps)
        cfg.trainer.max_steps = warmup + steps
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        if scratch is not None:  # nothing was written there
            os.rmdir(scratch)
        return 2
    for note in notes:
        print(note, flush=True)
    args.warmup, args.steps = warmup, steps
    try:
        return measure(args, cfg)
    finally:
        if scratch is not None and args.out:  # the report went elsewhere: the run's temp folder is spent
            shutil.rmtree(scratch, ignore_errors=True)


def measure(args: Any, cfg) -> int:
    """Build the run, take ``args.warmup`` + ``args.steps`` GRPO steps, write the report (``args.out``,
    else ``bench_grpo.json`` in the run's folder)."""
    # rollouts run ahead of the last measured step too, as in the middle of a run: without the extra
    # steps, the last one would train with an idle engine beside it
    cfg.trainer.max_steps += cfg.rollout.steps_ahead

    from nemo_orchestra.runtime.console import setup_logging

    setup_logging("WARNING", int(os.environ.get("RANK", 0)))  # before Megatron-Core and vLLM are imported
    import torch

    if cfg.perf.peak_tflops is None and not torch.cuda.is_available():
        cfg.perf.peak_tflops = matmul_peak_tflops(cfg.model.params_dtype)
    from nemo_orchestra.megatron.parallel import destroy_distributed, init_distributed
    from nemo_orchestra.train.build import build_trainer

    info = init_distributed(cfg.parallel, cfg.run.seed)
    with ExitStack() as stack:
        t0 = time.perf_counter()
        trainer = build_trainer(cfg, info, stack)
        stack.callback(trainer.close)
        trainer.warm_start()
        setup_s = time.perf_counter() - t0
        log = (lambda line: print(line, flush=True)) if info.is_main else None
        measured, run = run_steps(trainer, args.warmup, args.steps, log)
    destroy_distributed()
    if not info.is_main:
        return 0
    summary = summarize(measured)
    for key in (
        "engine_idle_share",
        "engine_calls_per_step",
        "sequences_per_engine_call",
        "graphs_captured_measured",
        "capture_s_measured",
    ):
        summary[key] = run[key]
    if run["graphs_captured_measured"]:
        print(
            f"note: {run['graphs_captured_measured']} decode shapes were first met, and captured as CUDA graphs "
            f"({run['capture_s_measured']:.2f} s), in the measured steps: a longer --warmup measures past them"
        )
    from nemo_orchestra.train.flops import peak_tflops

    summary["peak_tflops"] = peak_tflops(cfg.perf.peak_tflops) or float("nan")
    report = {
        "benchmark": "grpo",
        "config": {
            "model": cfg.model.name,
            "engine": cfg.rollout.engine,
            "parallel": vars(cfg.parallel),
            "params_dtype": cfg.model.params_dtype,
            "steps_ahead": cfg.rollout.steps_ahead,
            "prompts_per_step": cfg.data.prompts_per_step,
            "group_size": cfg.rollout.group_size,
            "max_turns": cfg.rollout.max_turns,
            "max_new_tokens_per_turn": cfg.rollout.max_new_tokens_per_turn,
            "warm_start_steps": cfg.warm_start.steps,
            "overrides": list(args.overrides),
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        },
        "setup_s": setup_s,
        "warmup_steps": args.warmup,
        "measured_steps": args.steps,
        "per_step": summary,
        "timeline": run["timeline"],
        "steps": [{k: v for k, v in m.items() if not isinstance(v, list)} for m in measured],
    }
    out = args.out or os.path.join(cfg.run.output_dir, "bench_grpo.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nGRPO step, model={cfg.model.name}, engine={cfg.rollout.engine}, device={report['machine']['device']}")
    print(table(summary))
    print(f"wrote {out}")
    return 0


def best_seconds(fn: Callable[[], Any], seconds: float, device=None) -> float:
    """The fastest of repeated calls of ``fn`` for ``seconds`` (after one warm-up call), each timed to
    its end on ``device`` (a CUDA device is synchronized)."""
    import torch

    def sync():
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_peak_tflops(params_dtype: str, n: int = 2048, seconds: float = 2.0, device=None) -> float:
    """The matmul throughput of ``device`` (default: the CPU) in the run's precision: the best of
    repeated n x n products."""
    import torch

    from nemo_orchestra.megatron.model import DTYPES

    dtype = DTYPES[params_dtype]
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / best_seconds(lambda: a @ b, seconds, device) / 1e12
