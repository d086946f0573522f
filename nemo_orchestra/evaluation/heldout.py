"""Held-out evaluation inside a run: one rollout per task with the current policy, summarized
overall, per category and per preference profile (accuracy, cost, cost per correct answer, tool use).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from nemo_orchestra.types import Trajectory


def summarize(trajs: list[Trajectory]) -> dict[str, float]:
    if not trajs:
        return {"n": 0}
    correct = sum(t.correct for t in trajs)
    total_cost = sum(t.cost for t in trajs)
    calls: dict[str, int] = defaultdict(int)
    for t in trajs:
        for k, v in t.tool_counts.items():
            calls[k] += v
    n_calls = sum(v for k, v in calls.items() if not k.startswith("expert-")) or 1
    n_expert = sum(v for k, v in calls.items() if k.startswith("expert-")) or 1
    out = {
        "n": len(trajs),
        "accuracy": correct / len(trajs),
        "cost_mean": total_cost / len(trajs),
        "cost_per_correct": total_cost / correct if correct else float("nan"),
        "latency_mean": statistics.fmean(t.latency_s for t in trajs),
        "turns_mean": statistics.fmean(len(t.turns) for t in trajs),
        "format_error_rate": sum(t.format_errors for t in trajs) / max(sum(len(t.turns) for t in trajs), 1),
        "plan_error_rate": sum(t.plan_errors for t in trajs) / max(sum(len(t.turns) for t in trajs), 1),
        "tool_error_rate": sum(t.tool_errors for t in trajs) / max(sum(len(t.turns) for t in trajs), 1),
    }
    for k, v in sorted(calls.items()):
        share = v / (n_expert if k.startswith("expert-") else n_calls)
        out[f"{'expert' if k.startswith('expert-') else 'tool'}_share/{k}"] = share
        # the share of rollouts that call k at least once (a multi-step chain is one that calls no expert-large)
        out[f"rollout_share/{k}"] = sum(t.tool_counts.get(k, 0) > 0 for t in trajs) / len(trajs)
    return out


def breakdown(trajs: list[Trajectory]) -> dict[str, dict[str, float]]:
    """Summaries for all tasks, per category, per preference profile (``meta.preference_name``) and
    per category under each profile (``category/<category>/<profile>``: the same kind of task under
    two preferences, where a preference-following policy differs)."""
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups["all"].append(t)
        groups[f"category/{t.task.category}"].append(t)
        if "preference_name" in t.task.meta:
            groups[f"preference/{t.task.meta['preference_name']}"].append(t)
            groups[f"category/{t.task.category}/{t.task.meta['preference_name']}"].append(t)
    return {k: summarize(v) for k, v in sorted(groups.items())}
