"""Multi-turn rollouts: G trajectories per prompt against the tool service.

Generation overlaps the tools: while some trajectories wait for their tool calls, the others'
next turns are generated in one batched engine call. Token ids are appended as produced — the
prompt once, each turn's generated ids (trained on), each observation's ids (masked out) — and
never re-tokenized.
A trajectory stops at an answer, at ``rollout.max_turns``, at the context limit, or when the
service ends the episode (its turn, cost or time guards).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from nemo_orchestra.config import RewardConfig, RolloutConfig
from nemo_orchestra.data.default_tasks import orchestrator_messages
from nemo_orchestra.prompting.chat import (
    ChatFormat,
    ToolCallParseError,
    parse_tool_call,
)
from nemo_orchestra.types import StopReason, TaskRecord, Trajectory

log = logging.getLogger(__name__)
# engines are driven from one thread, always the same (vLLM's client sockets are not thread-safe)
_ENGINE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-engine")


@dataclass
class _Live:
    traj: Trajectory
    episode_id: str
    tokens_read: int = 0  # orchestrator input tokens over all turns (each turn re-reads the context)
    tokens_written: int = 0


def prompt_messages(task: TaskRecord, reward_cfg: RewardConfig) -> list[dict]:
    return orchestrator_messages(task.problem, task.preference or reward_cfg.default_preference,
                                 task.meta.get("preference_name"))


async def run_rollouts(tasks: list[TaskRecord], group_size: int, engine, client, chat: ChatFormat,
                       cfg: RolloutConfig, reward_cfg: RewardConfig, seed: str = "", progress=None,
                       stats: dict | None = None) -> list[Trajectory]:
    """Roll out ``group_size`` trajectories for each task; trajectory.group = index of its task.

    Generation and tools overlap: the engine generates, in one batched call on its own thread,
    the next turn of every trajectory that is ready, while the tool calls of the others are in
    flight. A trajectory whose tool call returns joins the next batch; when none is ready the
    loop waits for the first to return, then up to ``cfg.batch_window_s`` for the rest, so one
    engine call serves many. ``stats``, when given, receives the time spent generating
    (``generate_s``), the time the engine sat idle waiting for tools (``env_wait_s``) and the
    engine calls made (``generate_calls``).

    Each episode gets its own ``meta.seed`` (``seed`` + its index), so the service's random draws
    (simulated experts) differ between the rollouts of a group as they would for sampled experts.
    """
    records = [{**t.to_dict(), "meta": {**t.meta, "seed": f"{seed}/{k}"}}
               for k, t in enumerate(t for t in tasks for _ in range(group_size))]
    created = await asyncio.gather(*[client.create_episode(r) for r in records])
    everyone: list[_Live] = []
    for k, ep in enumerate(created):
        task = tasks[k // group_size]
        ids = chat.prompt_ids(prompt_messages(task, reward_cfg), ep["tools"])
        traj = Trajectory(task=task, group=k // group_size, token_ids=list(ids), loss_mask=[0] * len(ids),
                          gen_logprobs=[0.0] * len(ids), prompt_len=len(ids))
        everyone.append(_Live(traj, ep["episode_id"]))
    stats = {} if stats is None else stats
    stats.update(generate_s=0.0, env_wait_s=0.0, generate_calls=0)
    ready: list[_Live] = list(everyone)
    in_flight: set[asyncio.Task] = set()
    finished = 0

    def stopped() -> None:
        nonlocal finished
        finished += 1
        if progress is not None:
            progress(finished, len(everyone))

    async def turn(x: _Live, gen) -> None:
        done = await _act(x, gen, client, chat)
        if not done and x.traj.turns >= cfg.max_turns:
            x.traj.stop_reason, done = StopReason.MAX_TURNS, True
        if done:
            stopped()
        else:
            ready.append(x)

    try:
        while ready or in_flight:
            if not ready:  # all wait for tools: wait for the first, then briefly for the rest
                t0 = time.perf_counter()
                done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                if in_flight and cfg.batch_window_s > 0:
                    more, in_flight = await asyncio.wait(in_flight, timeout=cfg.batch_window_s)
                    done |= more
                for d in done:
                    d.result()  # a tool call that raised ends the rollout with its error
                stats["env_wait_s"] += time.perf_counter() - t0
                continue
            batch = list(ready)
            ready.clear()  # turn() appends to this list
            for x in batch:
                if not _fits(x.traj, cfg):
                    x.traj.stop_reason = StopReason.CONTEXT
                    stopped()
            batch = [x for x in batch if not x.traj.stop_reason]
            if not batch:
                continue
            t0 = time.perf_counter()
            gens = await asyncio.get_running_loop().run_in_executor(
                _ENGINE_THREAD, engine.generate, [x.traj.token_ids for x in batch], cfg.max_new_tokens_per_turn,
                cfg.temperature, cfg.top_p, [chat.end_of_turn_id])
            stats["generate_s"] += time.perf_counter() - t0
            stats["generate_calls"] += 1
            in_flight |= {asyncio.ensure_future(turn(x, g)) for x, g in zip(batch, gens)}
        await asyncio.gather(*[_settle(x, client, cfg) for x in everyone])
    finally:
        for d in in_flight:
            d.cancel()
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
