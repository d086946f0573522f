"""Aggregate episode results per (policy, preference): table, Pareto front, JSON/CSV/PNG.

Per row: accuracy, mean cost ($), mean latency (s), mean turns, mean utility
u = alpha * 1[correct] - (1 - alpha) * cost, the tool-use distribution (share of all calls
per tool) and the expert-model distribution, and pass^k for k = 1 .. the samples every task has
(tau-bench's metric, Yao et al. 2024, arXiv 2406.12045: over tasks, the chance that k samples drawn
without replacement from a task's n are all correct, C(c, k) / C(n, k) for c correct). The Pareto front is over the rows' points in the
accuracy-cost plane: a point is on it when no other point is at most as expensive and at least
as accurate, and strictly better in one of the two. Reference policies that read the gold
answer (``oracle``) are shown but never part of the front. A row's user columns are the simulated
user's means (cost, latency, tokens in and out), apart from the policy's cost.

Per (policy, preference) whose results hold tau2 tasks, one file per tau2 domain,
``tau2_<domain>_<policy>_<preference>.json``, in tau2-bench's own ``Results`` format (tau2's
tooling reads it: ``Results.load``, ``tau2.metrics.agent_metrics.compute_metrics``): its ``tasks``,
and one ``SimulationRun`` per episode, ``trial`` numbered 0..k-1 per task in sample order. An
episode the grader recorded is its record; one that ended ungraded (its turn budget or a service
guard ran out first) is a ``max_steps`` run with reward 0 and no messages.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from nemo_orchestra.evaluation.harness import EpisodeResult

log = logging.getLogger(__name__)


REFERENCE_POLICIES = ("oracle",)  # read the gold answer: plotted for reference, never on the front


@dataclass
class Row:
    policy: str
    preference: str
    n: int
    accuracy: float
    mean_cost: float
    mean_latency_s: float
    mean_turns: float
    mean_utility: float
    format_errors: int
    tool_share: dict[str, float] = field(default_factory=dict)
    model_share: dict[str, float] = field(default_factory=dict)
    pass_hat_k: dict[str, float] = field(default_factory=dict)  # "k" -> pass^k
    pareto: bool = False
    # the simulated user's means per episode (0 where there is no user): not part of mean_cost/latency
    mean_user_cost: float = 0.0
    mean_user_latency_s: float = 0.0
    mean_user_tokens_in: float = 0.0
    mean_user_tokens_out: float = 0.0
    mean_wall_s: float = 0.0  # an episode's wall time, creation to end: the policy's turns, its tools, the user


def _share(counts: list[dict[str, int]]) -> dict[str, float]:
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    n = sum(total.values())
    return {k: round(v / n, 4) for k, v in sorted(total.items())} if n else {}


def pass_hat_k(results: list[EpisodeResult]) -> dict[str, float]:
    """pass^k for k = 1 .. the fewest samples any task has, averaged over tasks."""
    per_task: dict[str, list[bool]] = {}
    for r in results:
        per_task.setdefault(r.task_id, []).append(bool(r.correct))
    if not per_task:
        return {}
    kmax = min(len(v) for v in per_task.values())
    return {
        str(k): sum(math.comb(sum(v), k) / math.comb(len(v), k) for v in per_task.values()) / len(per_task)
        for k in range(1, kmax + 1)
    }


def summarize(results: list[EpisodeResult]) -> list[Row]:
    """One row per (policy, preference); the front among the policies that are not references."""
    groups: dict[tuple[str, str], list[EpisodeResult]] = {}
    for r in results:
        groups.setdefault((r.policy, r.preference), []).append(r)
    rows = []
    for (policy, pref), rs in groups.items():
        n = len(rs)
        rows.append(
            Row(
                policy=policy,
                preference=pref,
                n=n,
                accuracy=sum(r.correct for r in rs) / n,
                mean_cost=sum(r.cost for r in rs) / n,
                mean_latency_s=sum(r.latency_s for r in rs) / n,
                mean_turns=sum(r.turns for r in rs) / n,
                mean_utility=sum(r.utility for r in rs) / n,
                format_errors=sum(r.format_errors for r in rs),
                tool_share=_share([r.tool_counts for r in rs]),
                model_share=_share([r.model_counts for r in rs]),
                pass_hat_k=pass_hat_k(rs),
                mean_user_cost=sum(r.user_cost for r in rs) / n,
                mean_user_latency_s=sum(r.user_latency_s for r in rs) / n,
                mean_user_tokens_in=sum(r.user_tokens_in for r in rs) / n,
                mean_user_tokens_out=sum(r.user_tokens_out for r in rs) / n,
                mean_wall_s=sum(r.wall_s for r in rs) / n,
            )
        )
    candidates = [i for i, r in enumerate(rows) if r.policy not in REFERENCE_POLICIES]
    for j in pareto_front([(rows[i].mean_cost, rows[i].accuracy) for i in candidates]):
        rows[candidates[j]].pareto = True
    return rows


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (cost, accuracy) points no other point dominates, sorted by cost."""
    front = []
    for i, (c, a) in enumerate(points):
        dominated = any(c2 <= c and a2 >= a and (c2 < c or a2 > a) for j, (c2, a2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def rows_by_category(results: list[EpisodeResult]) -> dict[str, list[Row]]:
    """The rows of each task category on its own (a tau2 domain is its own category); the front is each one's."""
    cats: dict[str, list[EpisodeResult]] = {}
    for r in results:
        cats.setdefault(r.category, []).append(r)
    return {c: summarize(rs) for c, rs in sorted(cats.items())}


def _per_row_and_category(by_cat: dict[str, list[Row]], field: str) -> dict[str, dict[str, Any]]:
    """``{"policy|preference": {category: row.<field>}}`` from ``rows_by_category``."""
    out: dict[str, dict[str, Any]] = {}
    for category, rows in by_cat.items():
        for r in rows:
            out.setdefault(f"{r.policy}|{r.preference}", {})[category] = getattr(r, field)
    return out


def pass_hat_k_by_category(results: list[EpisodeResult]) -> dict[str, dict[str, dict[str, float]]]:
    """pass^k per (policy, preference) and task category (a tau2 domain is its own category)."""
    return _per_row_and_category(rows_by_category(results), "pass_hat_k")


def by_category(results: list[EpisodeResult]) -> dict[str, dict[str, float]]:
    """Accuracy per (policy, preference) and task category."""
    return _per_row_and_category(rows_by_category(results), "accuracy")


CSV_FIELDS = [
    "policy",
    "preference",
    "n",
    "accuracy",
    "mean_cost",
    "mean_latency_s",
    "mean_turns",
    "mean_utility",
    "format_errors",
    "pareto",
    "tool_share",
    "model_share",
    "pass_hat_k",
    "mean_user_cost",
    "mean_user_latency_s",
    "mean_user_tokens_in",
    "mean_user_tokens_out",
    "mean_wall_s",
]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _file_part(name: str) -> str:
    """``name`` as part of a file name: runs of characters other than [A-Za-z0-9._-] become one '_'."""
    return _UNSAFE.sub("_", name).strip("_") or "_"


def tau2_user_info(user: Any) -> dict[str, Any]:
    """tau2's ``UserInfo`` fields for the service config's ``user``: ``"replay"`` (the task's own script),
    an endpoint config (tau2's ``UserSimulator`` over its model), or None/unknown."""
    if user == "replay":
        return {"implementation": "nemo-orchestra/replay", "llm": None}
    if isinstance(user, dict) and user.get("model"):
        return {"implementation": "user_simulator", "llm": str(user["model"])}
    return {"implementation": "unknown", "llm": None}


def tau2_results(results: list[EpisodeResult], meta: dict[str, Any]) -> dict[tuple[str, str, str], Any]:
    """tau2's ``Results`` per (domain, policy, preference) over the results of tau2 tasks (pydantic-validated).

    ``meta``: ``tau2_user`` (the service config's ``user``, for ``info.user_info``), ``git_commit`` and
    ``seed`` (else ``config.seed``), each optional. ``info.max_steps`` is the episodes' largest turn budget
    (policy turns, -1: not known); ``agent_cost`` is the orchestrator's cost (tools and its own tokens)."""
    groups: dict[tuple[str, str, str], list[EpisodeResult]] = {}
    for r in results:
        if r.tau2 is not None:
            groups.setdefault((r.tau2["domain"], r.policy, r.preference), []).append(r)
    if not groups:
        return {}
    from tools_env.domains.tau2.episode import environment
    from tools_env.domains.tau2.package import require_tau2

    sim = require_tau2("tau2.data_model.simulation")
    tasks_model = require_tau2("tau2.data_model.tasks")
    seed = meta.get("seed", (meta.get("config") or {}).get("seed"))
    out = {}
    for (domain, policy, pref), rs in groups.items():
        tasks: dict[str, Any] = {}
        trials: dict[str, int] = {}
        simulations = []
        for r in sorted(rs, key=lambda r: (r.task_id, r.sample)):
            task = tasks_model.Task.model_validate(r.tau2["task"])
            tasks.setdefault(task.id, task)
            trial = trials[task.id] = trials.get(task.id, -1) + 1
            if r.record is not None:
                run = sim.SimulationRun.model_validate(r.record)
                if run.task_id != task.id:
                    raise ValueError(f"episode of task {r.task_id}: its record is of tau2 task {run.task_id!r}")
                if run.reward_info is None:
                    raise ValueError(f"episode of task {r.task_id}: its record has no reward_info (not graded)")
            else:  # the service graded nothing: the episode's end is now, its start its wall time before
                now = time.time()
                start, end = (time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) for t in (now - r.wall_s, now))
                run = sim.SimulationRun(
                    id=f"{_file_part(policy)}-{_file_part(pref)}-{_file_part(r.task_id)}-{r.sample}",
                    task_id=task.id,
                    timestamp=end,
                    start_time=start,
                    end_time=end,
                    duration=r.wall_s,
                    termination_reason=sim.TerminationReason.MAX_STEPS,
                    reward_info=sim.RewardInfo(reward=0.0, info={"note": r.reason}),
                    messages=[],
                )
            run.trial = trial
            run.agent_cost = r.cost
            run.user_cost = r.user_cost
            simulations.append(run)
        env = environment(domain)
        budgets = [r.max_turns for r in rs if r.max_turns is not None]
        info = sim.Info(
            git_commit=str(meta.get("git_commit") or "unknown"),
            num_trials=max(trials.values()) + 1,
            max_steps=max(budgets) if budgets else -1,  # the episodes' turn budget; -1: not known
            max_errors=-1,  # no limit on tool errors
            user_info=sim.UserInfo(**tau2_user_info(meta.get("tau2_user"))),
            agent_info=sim.AgentInfo(implementation=f"nemo-orchestra/{policy}"),
            environment_info=env.get_info(),
            seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        )
        out[(domain, policy, pref)] = sim.Results(info=info, tasks=list(tasks.values()), simulations=simulations)
    return out


def write_report(out_dir: str, rows: list[Row], results: list[EpisodeResult], meta: dict[str, Any]) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        k: os.path.join(out_dir, v)
        for k, v in (
            ("json", "results.json"),
            ("csv", "results.csv"),
            ("episodes", "episodes.jsonl"),
            ("png", "pareto.png"),
        )
    }
    by_cat = rows_by_category(results)
    with open(paths["json"], "w") as f:
        json.dump(
            {
                "meta": meta,
                "rows": [r.__dict__ for r in rows],
                "accuracy_by_category": _per_row_and_category(by_cat, "accuracy"),
                "pass_hat_k_by_category": _per_row_and_category(by_cat, "pass_hat_k"),
                "rows_by_category": {c: [r.__dict__ for r in rs] for c, rs in by_cat.items()},
            },
            f,
            indent=2,
            sort_keys=True,
        )
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            d = {k: getattr(r, k) for k in CSV_FIELDS}
            d["tool_share"] = json.dumps(r.tool_share, sort_keys=True)
            d["model_share"] = json.dumps(r.model_share, sort_keys=True)
            d["pass_hat_k"] = json.dumps(r.pass_hat_k, sort_keys=True)
            w.writerow(d)
    with open(paths["episodes"], "w") as f:
        for r in results:
            f.write(json.dumps(r.to_dict(), sort_keys=True) + "\n")
    for (domain, policy, pref), res in tau2_results(results, meta).items():
        name = f"tau2_{_file_part(domain)}_{_file_part(policy)}_{_file_part(pref)}"
        if name in paths:
            raise ValueError(f"two (domain, policy, preference) rows write {name}.json: rename a policy")
        paths[name] = os.path.join(out_dir, f"{name}.json")
        with open(paths[name], "w") as f:
            f.write(res.model_dump_json(indent=2))
    if not plot_pareto(rows, paths["png"], title=meta.get("title", "accuracy vs cost")):
        del paths["png"]
    return paths


def _x_fraction(x: float, xs: list[float], log_x: bool) -> float:
    f = (lambda v: math.log(v)) if log_x else (lambda v: v)
    lo, hi = f(min(xs)), f(max(xs))
    return 0.0 if hi == lo else (f(x) - lo) / (hi - lo)


def plot_pareto(rows: list[Row], path: str, title: str = "") -> bool:
    """Draw the rows and the front; False (with a warning) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed (the 'plot' extra): no %s written", path)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8), dpi=120)
    policies = sorted({r.policy for r in rows})
    prefs = sorted({r.preference for r in rows})
    markers = "os^Dv<>Ph*X"
    colors = plt.get_cmap("tab10")
    costs = [r.mean_cost for r in rows if r.mean_cost > 0]
    log_x = bool(costs) and max(costs) / min(costs) > 20
    zero_x = min(costs) / 3 if costs else 0.0  # where a free policy sits on a log axis

    def x_of(r: Row) -> float:
        return zero_x if log_x and r.mean_cost <= 0 else r.mean_cost

    groups: dict[tuple, list[Row]] = {}  # a policy that ignores the preference gives one point for all
    for r in rows:
        groups.setdefault((r.policy, round(r.mean_cost, 12), round(r.accuracy, 9)), []).append(r)
    for (policy, _, _), rs in groups.items():
        r = rs[0]
        marker = markers[prefs.index(r.preference) % len(markers)] if len(rs) == 1 else "o"
        ax.scatter(
            x_of(r),
            r.accuracy,
            s=70,
            color=colors(policies.index(policy) % 10),
            marker=marker,
            edgecolor="black",
            linewidth=0.6,
            zorder=3,
        )
        label = policy if len(prefs) == 1 else f"{policy} / {', '.join(x.preference for x in rs)}"
        if policy in REFERENCE_POLICIES:
            label += " (reads gold)"
        if log_x and r.mean_cost <= 0:
            label += ", $0"
        right = _x_fraction(x_of(r), [x_of(x) for x in rows], log_x) > 0.6  # label leftwards near the right edge
        ax.annotate(
            label,
            (x_of(r), r.accuracy),
            textcoords="offset points",
            xytext=(-6 if right else 6, 5),
            ha="right" if right else "left",
            fontsize=8,
        )
    front = [r for r in rows if r.pareto]
    front.sort(key=lambda r: r.mean_cost)
    if front:
        xs, ys = [front[0].mean_cost], [front[0].accuracy]
        for r in front[1:]:  # staircase: what the best policy at or below each cost achieves
            xs += [r.mean_cost, r.mean_cost]
            ys += [ys[-1], r.accuracy]
        ax.plot(xs, ys, color="gray", linestyle="--", linewidth=1.2, zorder=2, label="Pareto front")
    if log_x:
        ax.set_xscale("log")
    for i, p in enumerate(policies):
        ax.scatter([], [], color=colors(i % 10), label=p)
    if any(len(rs) == 1 for rs in groups.values()) and len(prefs) > 1:
        for i, p in enumerate(prefs):
            ax.scatter([], [], color="white", edgecolor="black", marker=markers[i % len(markers)], label=f"pref: {p}")
    ax.set_xlabel("mean cost per task ($)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.03, 1.05)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
