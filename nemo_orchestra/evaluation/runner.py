"""Run policies over task records through the tool service, one episode per (task, policy, preference, sample).

An episode: create it from the record (its preference replaced by the evaluated one), then
turn by turn ask the policy for a call and step the service until the service says done or
``max_turns`` pass. A turn without a valid call is counted (``format_errors``) and answered
with an error message, as the trainer does. The result carries the service's outcome, cost
(tool cost from the service plus the policy's own tokens), latency and per-tool counts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from nemo_orchestra.evaluation.policy import Policy, PolicyFormatError, PolicyInput

log = logging.getLogger(__name__)


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

    @property
    def utility(self) -> float:
        """u = alpha * 1[correct] - (1 - alpha) * cost."""
        return self.alpha * float(self.correct) - (1.0 - self.alpha) * self.cost

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "utility": self.utility}


def alpha_of(preference: dict[str, Any]) -> float:
    """alpha = w_accuracy / (w_accuracy + w_cost); 1 when neither is set."""
    acc, cost = float(preference.get("accuracy", 1.0)), float(preference.get("cost", 0.0))
    return acc / (acc + cost) if acc + cost > 0 else 1.0


def _call_message(turn: int, name: str, arguments: dict[str, Any], text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text,
            "tool_calls": [{"id": f"call_{turn}", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments)}}]}


async def run_episode(client: Any, policy: Policy, record: dict[str, Any], *, preference: dict[str, Any] | None,
                      preference_name: str = "record", sample: int = 0, max_turns: int = 12,
                      alpha: float | None = None) -> EpisodeResult:
    task = dict(record)
    profile = (record.get("meta") or {}).get("preference_name")  # the record's own profile, in words
    if preference is not None:
        task["preference"], profile = preference, None
    created = await client.create_episode(task)
    eid = created["episode_id"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["problem"]}]
    policy_cost, format_errors, outcome = 0.0, 0, None
    try:
        for turn in range(max_turns):
            inp = PolicyInput(task_id=task["id"], problem=task["problem"], category=task["category"],
                              tools=created["tools"], messages=messages, prices=task.get("prices", {}),
                              preference=task.get("preference", {}), turn=turn, sample=sample,
                              preference_name=profile)
            try:
                call = await policy.act(inp)
            except PolicyFormatError as e:
                format_errors += 1
                policy_cost += getattr(e, "cost", 0.0)
                messages += [{"role": "assistant", "content": getattr(e, "text", "")},
                             {"role": "user", "content": f"error: {e}. Call exactly one tool."}]
                continue
            except Exception as e:  # an unreachable model endpoint ends this episode, not the evaluation
                log.warning("policy %s failed on task %s: %s", policy.name, task["id"], e)
                outcome = {"correct": False, "reason": f"policy failed: {type(e).__name__}: {e}"}
                break
            policy_cost += call.cost
            step = await client.step(eid, call.name, call.arguments)
            messages += [_call_message(turn, call.name, call.arguments, call.text),
                         {"role": "tool", "tool_call_id": f"call_{turn}", "content": step["observation"]}]
            if step["done"]:
                outcome = step["outcome"]
                break
        summary = await client.get_episode(eid)
    finally:
        await client.delete_episode(eid)
    if outcome is None:
        outcome = {"correct": False, "reason": f"no answer within {max_turns} policy turns"}
    pref = task.get("preference", {})
    return EpisodeResult(
        task_id=task["id"], category=task["category"], domain=task.get("domain"), policy=policy.name,
        preference=preference_name, sample=sample, correct=bool(outcome["correct"]), reason=outcome["reason"],
        cost=summary["total_cost"] + policy_cost, tool_cost=summary["total_cost"], policy_cost=policy_cost,
        latency_s=summary["total_latency_s"], turns=summary["turns"], tool_counts=summary["tool_counts"],
        model_counts=summary["model_counts"], format_errors=format_errors, ended_by=summary["ended_by"],
        alpha=alpha if alpha is not None else alpha_of(pref),
    )


async def run_all(client: Any, policies: list[Policy], records: list[dict[str, Any]],
                  preferences: dict[str, dict[str, Any] | None], *, samples: int = 1, max_turns: int = 12,
                  alpha: float | None = None, concurrency: int = 16, progress: bool = True) -> list[EpisodeResult]:
    """Every (policy, preference, record, sample) episode, ``concurrency`` at a time, in a stable order."""
    jobs = [(p, name, pref, r, s) for p in policies for name, pref in preferences.items()
            for r in records for s in range(samples)]
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(jobs), desc="episodes", disable=not progress)

    async def one(p, name, pref, r, s):
        async with sem:
            res = await run_episode(client, p, r, preference=pref, preference_name=name, sample=s,
                                    max_turns=max_turns, alpha=alpha)
            bar.update(1)
            return res

    try:
        return list(await asyncio.gather(*(one(*j) for j in jobs)))
    finally:
        bar.close()
