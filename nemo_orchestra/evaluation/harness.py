"""Run policies over task records through the tool service, one episode per (task, policy, preference, sample).

Every episode runs in the agent loop training uses (``rollout.loop.run_episodes``): the same
prompt, the same handling of malformed calls (an error observation, counted as a format error)
and of records without a preference (``default_preference``, which the reward also uses). An
evaluated preference replaces the record's own, and then the record's profile words are not
shown (they describe the record's preference, not the evaluated one). A result carries the
service's outcome, cost (tool cost from the service plus the policy's own tokens), latency
and per-tool counts, the grader's own record of the episode (``outcome.record``: tau2's
``SimulationRun``) and the simulated user's totals, which are not the policy's cost or latency.
The user's totals are the service's (the episode summary's ``user``: its price, time and tokens
over the episode's user turns); 0 where the task has no user.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from nemo_orchestra.rollout.loop import HELDOUT_SEED, LoopLimits, TurnPolicy, run_episodes
from nemo_orchestra.types import StopReason, TaskRecord, Trajectory


@dataclass
class EpisodeResult:
    task_id: str
    category: str
    domain: str | None
    policy: str
    preference: str  # the preference's name in this evaluation
    sample: int
    correct: bool
    reason: str
    cost: float  # $: tool_cost + policy_cost
    tool_cost: float
    policy_cost: float
    latency_s: float  # summed latency of the tool calls (the service's accounting)
    turns: int
    tool_counts: dict[str, int] = field(default_factory=dict)
    model_counts: dict[str, int] = field(default_factory=dict)
    format_errors: int = 0
    ended_by: str | None = None
    alpha: float = 1.0  # utility weight of accuracy against cost for this episode
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation, OpenAI format
    record: dict[str, Any] | None = None  # the grader's record (outcome.record); None: none kept
    user_cost: float = 0.0  # $: the simulated user's, not in ``cost``
    user_latency_s: float = 0.0
    user_tokens_in: int = 0
    user_tokens_out: int = 0
    max_turns: int | None = None  # the turn budget the episode ran under
    wall_s: float = 0.0  # the episode's wall time: from its creation in the service to its end
    # a tau2 record's meta["tau2"] ({domain, split, task}); None: not a tau2 task. Not in to_dict: the
    # report's tau2 files hold the tasks
    tau2: dict[str, Any] | None = None

    @property
    def utility(self) -> float:
        """u = alpha * 1[correct] - (1 - alpha) * cost."""
        return self.alpha * float(self.correct) - (1.0 - self.alpha) * self.cost

    def to_dict(self) -> dict[str, Any]:
        out = {**asdict(self), "utility": self.utility}
        del out["tau2"]
        return out


def user_totals(status: dict[str, Any]) -> dict[str, float]:
    """A simulated user's totals from an episode summary's ``user`` (the service's accounting); 0 without one."""
    user = status.get("user") or {}
    return {
        "user_cost": float(user.get("cost") or 0.0),
        "user_latency_s": float(user.get("latency_s") or 0.0),
        "user_tokens_in": int(user.get("tokens_in") or 0),
        "user_tokens_out": int(user.get("tokens_out") or 0),
    }


def alpha_of(preference: dict[str, Any]) -> float:
    """alpha = w_accuracy / (w_accuracy + w_cost); 1 when neither is set."""
    acc, cost = float(preference.get("accuracy", 1.0)), float(preference.get("cost", 0.0))
    return acc / (acc + cost) if acc + cost > 0 else 1.0


def with_preference(task: TaskRecord, preference: dict[str, Any] | None) -> TaskRecord:
    """``task`` under an evaluated preference (None: its own); its profile words dropped when replaced."""
    if preference is None:
        return task
    meta = {k: v for k, v in task.meta.items() if k != "preference_name"}
    return dataclasses.replace(task, preference=dict(preference), meta=meta)


def to_result(
    traj: Trajectory, policy: str, preference: str, alpha: float | None, max_turns: int | None = None
) -> EpisodeResult:
    status = traj.meta.get("episode") or {}
    outcome = status.get("outcome") or {}
    record = outcome.get("record")
    tau2 = (traj.task.meta or {}).get("tau2")
    if traj.stop_reason == StopReason.POLICY_ERROR:
        reason = traj.meta.get("failure", "policy failed")
    else:
        reason = outcome.get("reason") or f"no answer ({traj.stop_reason} after {len(traj.turns)} policy turns)"
    return EpisodeResult(
        task_id=traj.task.id,
        category=traj.task.category,
        domain=traj.task.domain,
        policy=policy,
        preference=preference,
        sample=int(traj.meta.get("sample", 0)),
        correct=bool(traj.correct),
        reason=reason,
        cost=traj.cost,
        tool_cost=traj.tool_cost,
        policy_cost=traj.policy_cost,
        latency_s=traj.latency_s,
        turns=len(traj.turns),
        tool_counts=dict(status.get("tool_counts", {})),
        model_counts=dict(status.get("model_counts", {})),
        format_errors=traj.format_errors,
        ended_by=status.get("ended_by"),
        alpha=alpha if alpha is not None else alpha_of(traj.task.preference),
        messages=traj.messages,
        record=record if isinstance(record, dict) else None,
        **user_totals(status),
        max_turns=max_turns,
        wall_s=float(status.get("age_s") or 0.0),  # the summary is read as the episode ends
        tau2=tau2 if isinstance(tau2, dict) and "task" in tau2 else None,
    )


@dataclass
class PolicyRun:
    """A policy with the loop settings it is evaluated under."""

    policy: TurnPolicy
    limits: LoopLimits = field(default_factory=LoopLimits)
    default_preference: dict[str, float] = field(default_factory=dict)  # for records that state none


async def run_all(
    client: Any,
    runs: list[PolicyRun],
    records: list[TaskRecord],
    preferences: dict[str, dict[str, Any] | None],
    *,
    samples: int = 1,
    alpha: float | None = None,
    concurrency: int = 16,
    progress: bool = True,
    seed: str = HELDOUT_SEED,
) -> list[EpisodeResult]:
    """Every (policy, preference, record, sample) episode, ``concurrency`` live at a time, in a stable
    order. The service's random draws depend on the seed and the episode's index only, so every
    policy meets the same simulated experts' luck."""
    bar = tqdm(total=len(runs) * len(preferences) * len(records) * samples, desc="episodes", disable=not progress)
    results: list[EpisodeResult] = []
    try:
        for run in runs:
            for name, pref in preferences.items():
                done = [0]

                def tick(n: int, total: int, done=done) -> None:
                    bar.update(n - done[0])
                    done[0] = n

                trajs = await run_episodes(
                    [with_preference(r, pref) for r in records],
                    run.policy,
                    client,
                    samples=samples,
                    limits=run.limits,
                    default_preference=run.default_preference,
                    seed=seed,
                    concurrency=concurrency,
                    progress=tick,
                )
                results += [to_result(t, run.policy.name, name, alpha, run.limits.turn_budget(t.task)) for t in trajs]
    finally:
        bar.close()
    return results
