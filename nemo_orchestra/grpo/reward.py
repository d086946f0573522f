r"""The composite reward of ToolOrchestra, with cost and latency *penalized*.

For a group of n rollouts of one task, with outcome o_i in {0, 1}, cost c_i ($, orchestrator
tokens + tools), latency l_i (s, tool wall-clock) and per-tool call counts m_ik:

    mm(x_i) = (x_i - min_j x_j) / (max_j x_j - min_j x_j)      (0 when max = min; reward.normalize=minmax)
    mm(x_i) = (x_i - min_j x_j) / max_j x_j                    (reward.normalize=max)

    u_i = { accuracy: 1,  cost: 1 - mm(c_i),  latency: 1 - mm(l_i),  tool k: mm(m_ik) }

    linear:     R_i = o_i * sum_k w_k u_ik / sum_k |w_k|
    chebyshev:  R_i = o_i * (1 - max_k (w_k / max_j w_j) (1 - u_ik))

with w the task's preference vector (``accuracy``, ``cost``, ``latency``, ``tools``). An incorrect
rollout earns 0. The reference implementation min-max normalizes the *negated* cost and latency
but then adds the positive normalized values, so its reward grows with cost and latency unless
the weights are negative; here the cheaper and faster of two correct rollouts always earns more
(``tests/unit/test_reward.py`` checks the sign). Chebyshev scalarization reaches non-convex parts
of the accuracy-cost front that a linear sum cannot.

``reward.normalize``: min-max (the paper's) stretches any spread to [0, 1], so in a group that made
the same choice throughout, jitter (a simulated expert's latency drawn from its range, a few
tokens more in a query) becomes a reward gap as large as the gap between the cheapest and the
dearest expert, and the group's advantages train on that noise. Divided by the group's largest
value instead, a spread counts in proportion to the values themselves: the same as min-max when
the cheapest is far cheaper than the dearest (an expert-small call next to an expert-large one),
small when the values are close, so that such a group falls under ``advantage.min_group_std``.

``reward.latency_resolution_s`` (10 ms): each tool call's latency counts rounded to it. A local tool's
latency is its measured run time, microseconds that are the machine's noise: divided by a group's
largest value, that noise would part the latency utilities of rollouts that did the same, a reward
gap that trains calculator groups on timing, and the rewards would read the clock, so two runs of
one seed would drift apart. Per call, not the episode's sum: a simulated expert's drawn latency plus
a few microseconds of a local call would cross a rounding boundary now and then. Experts take
seconds, which 10 ms keeps (docs/algorithm.md).

Ablations (``conf/reward``): ``outcome_only`` (R = o), ``outcome_efficiency`` (config weights for
every task), ``full`` (the task's own preference vector).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nemo_orchestra.config import RewardConfig
from nemo_orchestra.types import Trajectory


def _normalizer(xs: Sequence[float], how: str = "minmax") -> Callable[[float], float]:
    """x -> (x - min) / (max - min) (``minmax``) or / max (``max``) with the min and max of ``xs``; 0 for
    every x when all of ``xs`` are equal."""
    lo, hi = min(xs), max(xs)
    if hi - lo <= 1e-12:
        return lambda x: 0.0
    scale = hi - lo if how == "minmax" else abs(hi)
    return lambda x: (x - lo) / scale


def _normalized(xs: Sequence[float], how: str = "minmax") -> list[float]:
    norm = _normalizer(xs, how)
    return [norm(x) for x in xs]


def _at_resolution(group: Sequence[Trajectory], resolution_s: float) -> list[float]:
    """Each rollout's latency, the sum of its calls' rounded to ``resolution_s`` (0: as measured)."""
    if resolution_s <= 0:
        return [t.latency_s for t in group]
    for t in group:
        if t.latency_s > 0 and not t.call_latencies_s:
            raise ValueError(
                f"reward.latency_resolution_s={resolution_s:g}: task {t.task.id}'s rollout reports "
                f"{t.latency_s:g} s of tool latency but no call's (Trajectory.call_latencies_s); "
                "set reward.latency_resolution_s=0 to use the totals"
            )
    return [latency_at_resolution(t.call_latencies_s, resolution_s) for t in group]


def group_rewards(group: Sequence[Trajectory], cfg: RewardConfig) -> list[float]:
    """Rewards of one group's rollouts (same task), in order."""
    outcome = [1.0 if t.correct else 0.0 for t in group]
    if not cfg.use_efficiency:
        return outcome
    prefs = group[0].task.preference if cfg.use_preference and group[0].task.preference else cfg.default_preference
    weights = {k: float(prefs.get(k, 0.0)) for k in ("accuracy", "cost", "latency")}
    utilities = {
        "accuracy": [1.0] * len(group),
        "cost": [1.0 - x for x in _normalized([t.cost for t in group], cfg.normalize)],
        "latency": [1.0 - x for x in _normalized(_at_resolution(group, cfg.latency_resolution_s), cfg.normalize)],
    }
    if cfg.use_preference:
        for tool, w in (prefs.get("tools") or {}).items():
            weights[f"tool:{tool}"] = float(w)
            utilities[f"tool:{tool}"] = _normalized([float(t.tool_counts.get(tool, 0)) for t in group])
    return [
        o * scalarize({k: utilities[k][i] for k in weights}, weights, cfg.scalarization) for i, o in enumerate(outcome)
    ]


def group_value(group: Sequence[Trajectory], cfg: RewardConfig) -> Callable[[bool, float, float], float] | None:
    """``value(correct, cost, latency)``: the reward a rollout of this group with that outcome, cost and
    latency (at ``reward.latency_resolution_s``) gets under the group's normalisation, as ``group_rewards``
    gives each of its own; the counterfactual of per-turn credit (``grpo/advantages.py``). None when the
    reward counts tool calls (a task's ``tools`` preference): those are not recorded per turn."""
    if not cfg.use_efficiency:
        return lambda correct, cost, latency: float(correct)
    prefs = group[0].task.preference if cfg.use_preference and group[0].task.preference else cfg.default_preference
    if cfg.use_preference and prefs.get("tools"):
        return None
    weights = {k: float(prefs.get(k, 0.0)) for k in ("accuracy", "cost", "latency")}
    norm_cost = _normalizer([t.cost for t in group], cfg.normalize)
    norm_latency = _normalizer(_at_resolution(group, cfg.latency_resolution_s), cfg.normalize)

    def value(correct: bool, cost: float, latency: float) -> float:
        u = {"accuracy": 1.0, "cost": 1.0 - norm_cost(cost), "latency": 1.0 - norm_latency(latency)}
        return float(correct) * scalarize(u, weights, cfg.scalarization)

    return value


def latency_at_resolution(call_latencies_s: Sequence[float], resolution_s: float) -> float:
    """Calls' latency as the reward counts it: each call's rounded to ``resolution_s`` (0: as measured)."""
    if resolution_s <= 0:
        return float(sum(call_latencies_s))
    return sum(round(x / resolution_s) * resolution_s for x in call_latencies_s)


def scalarize(u: dict[str, float], w: dict[str, float], how: str) -> float:
    total = sum(abs(x) for x in w.values())
    if total == 0:
        return 1.0
    if how == "linear":
        return sum(w[k] * u[k] for k in w) / total
    if how == "chebyshev":
        top = max(w.values())
        return 1.0 - max((w[k] / top) * (1.0 - u[k]) for k in w) if top > 0 else 1.0
    raise ValueError(f"reward.scalarization: unknown {how!r}")


def assign_rewards(trajectories: Sequence[Trajectory], cfg: RewardConfig) -> None:
    """Fill ``reward`` on every trajectory, group by group."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group, []).append(t)
    for group in groups.values():
        for t, r in zip(group, group_rewards(group, cfg)):
            t.reward = r
