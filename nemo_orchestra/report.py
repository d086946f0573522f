"""The run report: ``report.md`` (held-out before/after table) and ``curves.png`` (per-step curves)."""

from __future__ import annotations

import json
import logging
import math
import os

log = logging.getLogger(__name__)

COLUMNS = [("accuracy", "accuracy", "{:.3f}"), ("cost_mean", "mean cost $", "{:.6f}"),
           ("cost_per_correct", "cost per correct $", "{:.6f}"), ("latency_mean", "mean latency s", "{:.2f}"),
           ("turns_mean", "turns", "{:.2f}"), ("format_error_rate", "format errors", "{:.3f}")]


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return spec.format(value)


def write_report(out_dir: str, evals: dict[str, dict[str, dict[str, float]]], title: str) -> str:
    """``evals``: {stage ("warm start", "final"): breakdown()}; writes report.md and eval.json."""
    with open(os.path.join(out_dir, "eval.json"), "w") as f:
        json.dump(evals, f, indent=2)
    stages = list(evals)
    lines = [f"# {title}", "", "Held-out tasks, one greedy rollout each, before and after GRPO.", ""]
    groups = sorted({g for e in evals.values() for g in e}, key=lambda g: (g != "all", g))
    lines += ["| slice | stage | n | " + " | ".join(c[1] for c in COLUMNS) + " |",
              "| --- | --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |"]
    for g in groups:
        for s in stages:
            row = evals[s].get(g)
            if row:
                cells = " | ".join(_fmt(row.get(k), spec) for k, _, spec in COLUMNS)
                lines.append(f"| {g} | {s} | {row['n']} | {cells} |")
    aliases = _aliases(evals)
    if aliases:
        lines += ["", "Expert choice by category and preference profile (share of expert calls):", "",
                  "| slice | stage | " + " | ".join(aliases) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in aliases) + " |"]
    for g in groups if aliases else []:
        if not g.startswith(("preference/", "category/")) and g != "all":
            continue
        for s in stages:
            row = evals[s].get(g, {})
            lines.append(f"| {g} | {s} | " + " | ".join(_fmt(row.get(f"expert_share/{a}", 0.0), "{:.2f}")
                                                      for a in aliases) + " |")
    lines += ["", "![curves](curves.png)", "",
              "The held-out tasks are in `heldout.jsonl`; to recompute the final figures from the saved checkpoint:",
              "", "```bash", f"python recipes/evaluate.py tasks={out_dir}/heldout.jsonl output={out_dir}/evaluate "
              f"policies=checkpoint:{out_dir},strongest,cheapest preferences=record", "```", ""]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def _aliases(evals) -> list[str]:
    keys = {k for e in evals.values() for row in e.values() for k in row if k.startswith("expert_share/")}
    return sorted(k.split("/", 1)[1] for k in keys)


def plot_curves(out_dir: str) -> str | None:
    """Reward, accuracy and cost per step from metrics.jsonl; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no curves.png (pip install matplotlib)")
        return None
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r["step"] for r in rows]
    panels = [("reward/mean", "reward"), ("reward/outcome", "accuracy (training rollouts)"),
              ("rollout/cost_mean", "cost per rollout ($)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2))
    for ax, (key, label) in zip(axes, panels):
        ys = [r.get(key, float("nan")) for r in rows]
        ax.plot(steps, ys, marker="o", ms=3, lw=1, alpha=0.5)
        if len(ys) >= 4:
            w = max(2, len(ys) // 8)
            smooth = [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]
            ax.plot(steps, smooth, lw=2)
        ax.set_title(label)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, "curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
