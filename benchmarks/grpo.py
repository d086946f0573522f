"""``python recipes/benchmark.py grpo``: tokens/s of a GRPO step and where its time goes.

Builds the run the recipe would build from the same ``key=value`` overrides (the tiny default
on CPU; ``model=qwen3_8b`` and a real tokenizer on a GPU), runs ``--warmup`` unmeasured GRPO
steps, then ``--steps`` measured ones, and reports per step:

- ``generation_s``: the engine's generate calls (wall time, on the rollout's worker thread)
- ``environment_s``: the rest of the rollout: episode set-up, tool calls the engine waited
  for, and accounting (tool calls that overlap generation are not counted twice)
- ``reference_logprobs_s``: the frozen reference's forward pass over the packed batch
- ``training_s``: forward, backward and the optimizer step (the policy's old logprobs come from
  this forward: one optimizer step per batch of rollouts)
- ``weight_sync_s``: pushing the new weights into the generation engine
- ``tokens_per_s``: every token of the step's trajectories (prompts, generated turns,
  observations) over the step's wall time; ``generated_tokens_per_s`` over generation time.

The warm start is off unless asked for (``sft.steps=N``): an untrained policy writes whole
turns until ``rollout.max_new_tokens_per_turn``, the longest generation the config allows.
Groups whose rewards are all equal are kept (``advantage.min_group_std=-1``; the recipe drops
them), so every step trains on its whole batch and the timings do not depend on luck.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

PHASES = (("generation_s", "time/generate_s"), ("environment_s", None), ("reference_logprobs_s", "time/ref_logprobs_s"),
          ("training_s", "time/update_s"),
          ("weight_sync_s", "time/weight_sync_s"))
BENCH_DEFAULTS = ("sft.steps=0", "evaluation.enabled=false", "export.enabled=false", "checkpoint.save_every=0",
                  "advantage.min_group_std=-1.0")


def add_args(parser: Any) -> None:
    parser.add_argument("--steps", type=int, default=3, help="measured GRPO steps")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured GRPO steps first")
    parser.add_argument("--out", default=None, help="write the JSON report here (default: <run dir>/bench_grpo.json)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value, as for the recipe")


def summarize(steps: list[dict]) -> dict[str, float]:
    """Mean per-step figures from the trainer's metrics of the measured steps."""
    mean = statistics.fmean
    out: dict[str, float] = {}
    for name, key in PHASES:
        if key is not None:
            out[name] = mean(m.get(key, 0.0) for m in steps)
    out["environment_s"] = mean(m["time/rollout_s"] - m.get("time/generate_s", 0.0) for m in steps)
    out["step_s"] = mean(m["time/step_s"] for m in steps)
    out["other_s"] = out["step_s"] - sum(out[name] for name, _ in PHASES)
    out["tokens_per_step"] = mean(m["perf/tokens_per_s"] * m["time/step_s"] for m in steps)
    out["generated_tokens_per_step"] = mean(m["perf/generated_tokens"] for m in steps)
    out["tokens_per_s"] = out["tokens_per_step"] / out["step_s"]
    gen = out["generation_s"]
    out["generated_tokens_per_s"] = out["generated_tokens_per_step"] / gen if gen > 0 else float("nan")
    out["generate_calls_per_step"] = mean(m.get("rollout/generate_calls", 0) for m in steps)
    for key in ("perf/tflops_per_gpu", "perf/mfu", "perf/peak_mem_gb"):
        if all(key in m for m in steps):
            out[key.split("/", 1)[1]] = mean(m[key] for m in steps)
    return out


def table(summary: dict[str, float]) -> str:
    step = summary["step_s"]
    rows = [f"{'phase':<22}{'s/step':>10}{'share':>9}"]
    for name in [p for p, _ in PHASES] + ["other_s"]:
        rows.append(f"{name.removesuffix('_s'):<22}{summary[name]:>10.3f}{summary[name] / step:>9.1%}")
    rows.append(f"{'step':<22}{step:>10.3f}")
    rows.append(f"tokens/s {summary['tokens_per_s']:.0f} ({summary['tokens_per_step']:.0f} tokens/step); "
                f"generated tokens/s {summary['generated_tokens_per_s']:.0f} "
                f"({summary['generated_tokens_per_step']:.0f}/step in {summary['generate_calls_per_step']:.1f} "
                "engine calls)")
    return "\n".join(rows)


def main(args: Any) -> int:
    from nemo_orchestra.config import ConfigError, load_config

    if args.steps < 1 or args.warmup < 0:
        print(f"error: --steps must be >= 1 and --warmup >= 0 (got {args.steps} and {args.warmup})",
              file=sys.stderr)
        return 2
    overrides = list(args.overrides)
    if not any(o.startswith("run.output_dir=") for o in overrides):
        overrides.append(f"run.output_dir={tempfile.mkdtemp(prefix='bench_grpo-')}")
    try:
        cfg = load_config([*BENCH_DEFAULTS, *overrides, f"trainer.max_steps={args.warmup + args.steps}"])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    from nemo_orchestra.train.console import setup_logging

    setup_logging("WARNING", int(os.environ.get("RANK", 0)))  # before Megatron-Core and vLLM are imported
    import torch

    from nemo_orchestra.megatron.parallel import destroy_distributed, init_distributed
    from nemo_orchestra.train.build import build_trainer
    info = init_distributed(cfg.parallel, cfg.run.seed)
    measured: list[dict] = []
    with ExitStack() as stack:
        t0 = time.perf_counter()
        trainer = build_trainer(cfg, info, stack)
        stack.callback(trainer.close)
        trainer.warm_start()
        setup_s = time.perf_counter() - t0
        for i in range(args.warmup + args.steps):
            m = trainer.grpo_step()
            trainer.step += 1
            tag = "warmup" if i < args.warmup else "measured"
            if info.is_main:
                print(f"step {i + 1}/{args.warmup + args.steps} ({tag}): {m['time/step_s']:.2f} s, "
                      f"{m['perf/tokens_per_s']:.0f} tokens/s", flush=True)
            if i >= args.warmup:
                measured.append(m)
    destroy_distributed()
    if not info.is_main:
        return 0
    summary = summarize(measured)
    report = {
        "benchmark": "grpo",
        "config": {"model": cfg.model.name, "engine": cfg.rollout.engine, "parallel": vars(cfg.parallel),
                   "prompts_per_step": cfg.data.prompts_per_step, "group_size": cfg.rollout.group_size,
                   "max_turns": cfg.rollout.max_turns, "max_new_tokens_per_turn": cfg.rollout.max_new_tokens_per_turn,
                   "sft_steps": cfg.sft.steps, "overrides": list(args.overrides)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"},
        "setup_s": setup_s, "warmup_steps": args.warmup, "measured_steps": args.steps,
        "per_step": summary, "steps": [{k: v for k, v in m.items() if not isinstance(v, list)} for m in measured],
    }
    out = args.out or os.path.join(cfg.run.output_dir, "bench_grpo.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nGRPO step, model={cfg.model.name}, engine={cfg.rollout.engine}, device={report['machine']['device']}")
    print(table(summary))
    print(f"wrote {out}")
    return 0
