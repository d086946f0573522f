"""The run report: ``report.md`` (held-out before/after table) and ``curves.png`` (per-step curves)."""

from __future__ import annotations

import json
import logging
import math
import os

log = logging.getLogger(__name__)

COLUMNS = [
    ("accuracy", "accuracy", "{:.3f}"),
    ("cost_mean", "mean cost $", "{:.6f}"),
    ("cost_per_correct", "cost per correct $", "{:.6f}"),
    ("latency_mean", "mean latency s", "{:.2f}"),
    ("turns_mean", "turns", "{:.2f}"),
    ("format_error_rate", "format errors", "{:.3f}"),
]


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return spec.format(value)


STAGES = (
    "Held-out tasks before and after GRPO. `step N`: one rollout per task at `evaluation.temperature` "
    "(0: greedy); `step N, K samples`: K rollouts per task at `rollout.temperature` and `rollout.top_p`, "
    "as GRPO samples them, each figure over all K rollouts of every task (n counts rollouts)."
)


def write_report(out_dir: str, evals: dict[str, dict[str, dict[str, float]]], title: str, sampled: str = "") -> str:
    """``evals``: {stage ("step 0", "step 0, 8 samples", "step 80", ...): breakdown()}; writes report.md
    and eval.json. ``sampled``: the evaluate.py arguments that recompute the sampled stages."""
    with open(os.path.join(out_dir, "eval.json"), "w") as f:
        json.dump(evals, f, indent=2)
    stages = list(evals)
    lines = [f"# {title}", "", STAGES, ""]
    groups = sorted({g for e in evals.values() for g in e}, key=lambda g: (g != "all", g))
    lines += [
        "| slice | stage | n | " + " | ".join(c[1] for c in COLUMNS) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    for g in groups:
        for s in stages:
            row = evals[s].get(g)
            if row:
                cells = " | ".join(_fmt(row.get(k), spec) for k, _, spec in COLUMNS)
                lines.append(f"| {g} | {s} | {row['n']} | {cells} |")
    aliases = _aliases(evals)
    if aliases:
        lines += [
            "",
            "Expert choice by category and preference profile (share of expert calls):",
            "",
            "| slice | stage | " + " | ".join(aliases) + " |",
            "| --- | --- | " + " | ".join("---" for _ in aliases) + " |",
        ]
    for g in groups if aliases else []:
        if not g.startswith(("preference/", "category/")) and g != "all":
            continue
        for s in stages:
            row = evals[s].get(g, {})
            lines.append(
                f"| {g} | {s} | "
                + " | ".join(_fmt(row.get(f"expert_share/{a}", 0.0), "{:.2f}") for a in aliases)
                + " |"
            )
    lines += [
        "",
        "![curves](curves.png)",
        "",
        "The held-out tasks are in `heldout.jsonl`; to recompute the final figures from the saved checkpoint"
        + (" (the second command draws the sampled ones afresh):" if sampled else ":"),
        "",
        "```bash",
        f"python recipes/evaluate.py tasks={out_dir}/heldout.jsonl output={out_dir}/evaluate "
        f"policies=checkpoint:{out_dir},strongest,cheapest preferences=record",
        *(
            [
                f"python recipes/evaluate.py tasks={out_dir}/heldout.jsonl output={out_dir}/evaluate_sampled "
                f"policies=checkpoint:{out_dir} preferences=record {sampled}"
            ]
            if sampled
            else []
        ),
        "```",
        "",
    ]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def _aliases(evals) -> list[str]:
    keys = {k for e in evals.values() for row in e.values() for k in row if k.startswith("expert_share/")}
    return sorted(k.split("/", 1)[1] for k in keys)


def _smooth(ys: list[float]) -> list[float]:
    """Trailing mean over about an eighth of the run (NaN steps skipped)."""
    w = max(2, len(ys) // 8)
    out = []
    for i in range(len(ys)):
        xs = [y for y in ys[max(0, i - w + 1) : i + 1] if y == y]
        out.append(sum(xs) / len(xs) if xs else float("nan"))
    return out


def plot_curves(out_dir: str) -> str | None:
    """Reward, accuracy, cost and format errors per step, the expert choice per preference profile, and the
    share of rollouts that call expert-large per task kind (category/profile), from metrics.jsonl; None
    without matplotlib."""
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
    panels = [
        ("reward/mean", "reward"),
        ("reward/outcome", "accuracy (training rollouts)"),
        ("rollout/cost_mean", "cost per rollout ($)"),
        ("rollout/format_error_rate", "format errors a turn"),
    ]
    share = "rollout/expert_share/"  # rollout/expert_share/<profile>/<alias>, see trainer.rollout_metrics
    profiles = sorted({k[len(share) :].split("/")[0] for r in rows for k in r if k.startswith(share)})
    large = "rollout/large_rollouts/"  # rollout/large_rollouts/<category>/<profile>, see step_metrics
    kinds = sorted({k[len(large) :] for r in rows for k in r if k.startswith(large)})
    n = len(panels) + len(profiles) + bool(kinds)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.2))
    for ax, (key, label) in zip(axes, panels):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="o", ms=3, lw=1, alpha=0.5)
        ax.plot(steps, _smooth([r.get(key, float("nan")) for r in rows]), lw=2)
        ax.set_title(label)
    for ax, name in zip(axes[len(panels) :], profiles):
        prefix = f"{share}{name}/"
        for alias in sorted({k[len(prefix) :] for r in rows for k in r if k.startswith(prefix)}):
            ax.plot(steps, _smooth([r.get(prefix + alias, float("nan")) for r in rows]), lw=2, label=alias)
        ax.set_title(f"expert choice, {name} tasks")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    if kinds:
        ax = axes[-1]
        categories = sorted({k.split("/")[0] for k in kinds})
        styles = ["-", "--", ":", "-."]
        for kind in kinds:  # a step without the kind among its rollouts: NaN, skipped by the trailing mean
            category, _, profile = kind.partition("/")
            ys = _smooth([r.get(large + kind, float("nan")) for r in rows])
            color, style = (
                f"C{categories.index(category)}",
                styles[profiles.index(profile) % 4 if profile in profiles else 0],
            )
            ax.plot(steps, ys, lw=2, color=color, ls=style, label=kind)
        ax.set_title("rollouts calling expert-large")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=6)
    for ax in axes:
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, "curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
