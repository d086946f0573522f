"""Multi-turn rollouts: G trajectories per prompt against the tool service.

Every live trajectory generates its next turn in one batched call; the tool calls of all of
them then run concurrently. Token ids are appended as produced — the prompt once, each turn's
generated ids (trained on), each observation's ids (masked out) — and never re-tokenized.
A trajectory stops at an answer, at ``rollout.max_turns``, at the context limit, or when the
service ends the episode (its turn, cost or time guards).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nemo_orchestra.chat import ChatFormat, ToolCallParseError, parse_tool_call
from nemo_orchestra.config import RewardConfig, RolloutConfig
from nemo_orchestra.data.default_tasks import system_prompt
from nemo_orchestra.types import StopReason, TaskRecord, Trajectory

log = logging.getLogger(__name__)


@dataclass
class _Live:
    traj: Trajectory
    episode_id: str
    tokens_read: int = 0  # orchestrator input tokens over all turns (each turn re-reads the context)
    tokens_written: int = 0


def prompt_messages(task: TaskRecord, reward_cfg: RewardConfig) -> list[dict]:
    return [{"role": "system", "content": system_prompt(task.preference or reward_cfg.default_preference)},
            {"role": "user", "content": task.problem}]


async def run_rollouts(tasks: list[TaskRecord], group_size: int, engine, client, chat: ChatFormat,
                       cfg: RolloutConfig, reward_cfg: RewardConfig, seed: str = "", progress=None) -> list[Trajectory]:
    """Roll out ``group_size`` trajectories for each task; trajectory.group = index of its task.

    Each episode gets its own ``meta.seed`` (``seed`` + its index), so the service's random draws
    (simulated experts) differ between the rollouts of a group as they would for sampled experts.
    """
    records = [{**t.to_dict(), "meta": {**t.meta, "seed": f"{seed}/{k}"}}
               for k, t in enumerate(t for t in tasks for _ in range(group_size))]
    created = await asyncio.gather(*[client.create_episode(r) for r in records])
    live: list[_Live] = []
    for k, ep in enumerate(created):
        task = tasks[k // group_size]
        ids = chat.prompt_ids(prompt_messages(task, reward_cfg), ep["tools"])
        traj = Trajectory(task=task, group=k // group_size, token_ids=list(ids), loss_mask=[0] * len(ids),
                          gen_logprobs=[0.0] * len(ids), prompt_len=len(ids))
        live.append(_Live(traj, ep["episode_id"]))
    everyone = list(live)
    try:
        for turn in range(cfg.max_turns):
            live = [x for x in live if _fits(x.traj, cfg)]
            for x in everyone:
                if not x.traj.stop_reason and x not in live:
                    x.traj.stop_reason = StopReason.CONTEXT
            if not live:
                break
            gens = engine.generate([x.traj.token_ids for x in live], cfg.max_new_tokens_per_turn,
                                   cfg.temperature, cfg.top_p, [chat.end_of_turn_id])
            results = await asyncio.gather(*[_act(x, g, client, chat) for x, g in zip(live, gens)])
            live = [x for x, done in zip(live, results) if not done]
            if progress is not None:
                progress(turn + 1, len(everyone) - len(live), len(everyone))
        for x in live:
            x.traj.stop_reason = x.traj.stop_reason or StopReason.MAX_TURNS
        await asyncio.gather(*[_settle(x, client, cfg) for x in everyone])
    finally:
        await asyncio.gather(*[client.delete_episode(x.episode_id) for x in everyone], return_exceptions=True)
    return [x.traj for x in everyone]


def _fits(traj: Trajectory, cfg: RolloutConfig) -> bool:
    return len(traj.token_ids) + cfg.max_new_tokens_per_turn <= cfg.max_context


async def _act(x: _Live, gen, client, chat: ChatFormat) -> bool:
    """Append one generated turn, execute its tool call, append the observation. True when done."""
    t = x.traj
    x.tokens_read += len(t.token_ids)
    x.tokens_written += len(gen.token_ids)
    t.token_ids += gen.token_ids
    t.loss_mask += [1] * len(gen.token_ids)
    t.gen_logprobs += gen.logprobs
    t.turns += 1
    if not gen.finished:  # close the turn the way the template does, as a non-trained token
        t.token_ids.append(chat.end_of_turn_id)
        t.loss_mask.append(0)
        t.gen_logprobs.append(0.0)
    call = None
    try:
        call = parse_tool_call(chat.decode(gen.token_ids))
    except ToolCallParseError as e:
        result = {"observation": f"Error: {e}. Call a tool as <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}</tool_call>.",
                  "done": False, "error": str(e)}
    else:
        result = await client.step(x.episode_id, call.name, call.arguments)
    if result.get("error"):
        t.tool_errors += 1
    if result.get("done"):
        t.stop_reason = StopReason.ANSWER if call is not None and call.name == "answer" else StopReason.SERVICE_GUARD
        t.correct = bool((result.get("outcome") or {}).get("correct", False))
        return True
    obs_ids = chat.encode(chat.observation_suffix(str(result.get("observation", ""))))
    t.token_ids += obs_ids
    t.loss_mask += [0] * len(obs_ids)
    t.gen_logprobs += [0.0] * len(obs_ids)
    return False


async def _settle(x: _Live, client, cfg: RolloutConfig) -> None:
    """Read the episode's accounting from the service; add the orchestrator's own token cost."""
    status = await client.get_episode(x.episode_id)
    t = x.traj
    t.tool_cost = float(status["total_cost"])
    t.latency_s = float(status["total_latency_s"])
    t.tool_counts = {**status.get("tool_counts", {}), **status.get("model_counts", {})}  # tools and expert aliases
    t.policy_cost = (x.tokens_read * cfg.orchestrator_price_in + x.tokens_written * cfg.orchestrator_price_out) / 1e6
    outcome = status.get("outcome") or {}
    if outcome:
        t.correct = bool(outcome.get("correct", False))
    assert len(t.token_ids) == len(t.loss_mask) == len(t.gen_logprobs)
