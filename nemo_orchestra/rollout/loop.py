"""The agent loop: one episode loop for training rollouts, held-out evaluation and ``evaluate.py``.

An episode: the tool service creates it from a task record (its preference filled in with the
default when it has none), the loop builds its messages (``prompting.prompts.task_messages``),
then turn by turn asks the policy for an assistant turn, reads the tool call in it, steps the
service and appends the observation, until the service ends the episode (an answer, or its turn,
cost or time guards), ``max_turns`` pass, or the context is full. A turn without a valid call gets
the same error observation on every path and counts as a format error.

Policies differ only in how a turn is produced (``TurnPolicy.act``):

- token-level policies (``EnginePolicy``: a generation engine, in training or on an exported
  checkpoint) continue the episode's token ids; the loop keeps them as they are — the prompt once,
  each turn's generated ids (trained on), each observation's ids (masked out) — and never
  re-tokenizes. Their ``chat`` is the chat format the observation suffix comes from.
- message-level policies (an OpenAI-compatible endpoint, the routing baselines) read the
  episode's OpenAI ``messages`` and ``tools``. The same messages, rendered by the chat template,
  are the token ids a token-level policy sees.

Generation overlaps the tools: while some episodes wait for their tool calls, the policy produces
the next turn of every episode that is ready in one call (one batched engine call). When none is
ready the loop waits for the first tool call to return, then up to ``batch_window_s`` for others.
Which episodes share a call is a matter of timing, so a sampled turn draws from a seed of its own
(``turn_seed``: the episode's seed and the turn's index), not from the batch's: a run's rollouts
are the same however its tool calls interleave.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from nemo_orchestra.config import RolloutConfig
from nemo_orchestra.data.default_tasks import misstated_plan
from nemo_orchestra.prompting.call_prefix import break_index
from nemo_orchestra.prompting.chat import (
    ChatFormat,
    ParsedTurn,
    ToolCall,
    Transcript,
    parse_server_message,
    parse_turn,
    tool_call_message,
    tool_message,
)
from nemo_orchestra.prompting.prompts import task_messages, with_default_preference
from nemo_orchestra.rollout import scheduler
from nemo_orchestra.rollout.engines.base import GenerationEngine
from nemo_orchestra.rollout.scheduler import EngineWeights
from nemo_orchestra.types import StopReason, TaskRecord, Trajectory, TurnRecord
from tools_env.tools.base import ToolArgumentError, check_arguments

log = logging.getLogger(__name__)


# the seed of evaluation episodes (a run's held-out report, evaluate.py): the service's draws for the
# k-th episode depend on it and k only, so every policy meets the same simulated experts' luck
HELDOUT_SEED = "heldout"


def format_error_observation(error: str) -> str:
    """What the policy reads after a turn without a valid tool call, on every path."""
    return f'Error: {error}. Call a tool as <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>.'


@dataclass
class LoopLimits:
    max_turns: int = 12
    task_turns: bool = True  # a task record's own max_turns, when it has one, instead of max_turns
    max_context: int | None = None  # tokens, for token-level policies; None: no limit here
    turn_tokens: int = 0  # tokens a turn may add (the engine's max_new_tokens): room kept for it
    batch_window_s: float = 0.0
    price_in: float = 0.2  # $/1M tokens the policy itself reads (Qwen3-8B as the orchestrator: 0.2)
    price_out: float = 0.2

    @classmethod
    def from_rollout(cls, cfg: RolloutConfig) -> "LoopLimits":
        return cls(
            max_turns=cfg.max_turns,
            task_turns=cfg.task_turns,
            max_context=cfg.max_context,
            turn_tokens=cfg.max_new_tokens_per_turn,
            batch_window_s=cfg.batch_window_s,
            price_in=cfg.orchestrator_price_in,
            price_out=cfg.orchestrator_price_out,
        )

    def turn_budget(self, task: TaskRecord) -> int:
        """The turns an episode of ``task`` may take."""
        return task.max_turns if self.task_turns and task.max_turns else self.max_turns


@dataclass
class Turn:
    """One assistant turn, as a policy produced it."""

    text: str  # the turn as written (its plan, then the <tool_call> block), without the end-of-turn token
    token_ids: list[int] | None = None  # token-level policies: the generated ids, kept as they are
    logprobs: list[float] | None = None
    finished: bool = True  # ended with the end-of-turn token (False: cut at the token budget)
    call: ToolCall | None = None  # a call the policy decided as such (the routing baselines), after ``text``
    message: dict[str, Any] | None = None  # the assistant message an OpenAI-compatible server returned
    prompt_tokens: int = 0  # the policy's own tokens this turn, priced by LoopLimits
    completion_tokens: int = 0
    failure: str | None = None  # the policy could not produce a turn (an unreachable endpoint)
    version: int = 0  # the policy version that wrote it (token-level policies: the engine's weights)


@dataclass
class Episode:
    """A live episode as a policy sees it: the task, the tools, the conversation so far."""

    task: TaskRecord  # with its preference filled in
    group: int  # index of the task in the call; the samples of a task share it
    sample: int  # index of this attempt at the task
    episode_id: str
    tools: list[dict[str, Any]]  # OpenAI function schemas, as the service returned them
    messages: list[dict[str, Any]]
    traj: Trajectory
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seed: str = ""  # the episode's seed (``run_episodes``): its service draws, and with the turn its sampling
    transcript: Transcript | None = None  # token-level policies: the text of ``traj.token_ids``
    turn_tokens: list[tuple[int, int]] = field(default_factory=list)  # each turn's (prompt, completion) tokens

    @property
    def turn(self) -> int:
        return len(self.traj.turns)

    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def expert_aliases(self) -> list[str]:
        for t in self.tools:
            if t["function"]["name"] == "expert":
                return list(t["function"]["parameters"]["properties"]["model"].get("enum", []))
        return []

    def last_observation(self) -> str:
        for m in reversed(self.messages):
            if m["role"] == "tool":
                return m["content"]
        return ""


def turn_seed(ep: Episode, salt: str = "") -> int:
    """The sampling seed of ``ep``'s next turn, in [0, 2**63): a hash of the episode's seed, the
    turn's index and ``salt`` (a policy's own seed), the same in every process and run."""
    digest = hashlib.blake2b(f"{salt}|{ep.seed}|{ep.turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class TurnPolicy(Protocol):
    name: str
    chat: ChatFormat | None  # token-level policies: the chat format of their token ids; None: messages

    async def act(self, episodes: list[Episode]) -> list[Turn]:
        """The next turn of each episode (one call for all: an engine batches them)."""
        ...

    async def aclose(self) -> None: ...


@dataclass
class EnginePolicy:
    """A generation engine as the policy: continues each episode's token ids (training, held-out
    evaluation, an exported checkpoint in ``evaluate.py``)."""

    engine: GenerationEngine
    chat: ChatFormat
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    name: str = "engine"
    weights: EngineWeights | None = None  # the version of the engine's weights, read with each call
    # place of this policy's calls on the engine thread (scheduler.EngineThread): -inf for a caller that waits
    # now; the step, for rollouts ahead of training
    priority: float = -math.inf
    seed: str = ""  # mixed into every turn's sampling seed (turn_seed): another seed, other draws
    seed_per_turn: bool = True  # False: the engine's own generator for each call (rollout.seed_per_turn)

    async def act(self, episodes: list[Episode]) -> list[Turn]:
        seeds = [turn_seed(e, self.seed) for e in episodes] if self.seed_per_turn else None

        def generate():  # on the engine thread, so no weight load can come between the version and the call
            version = self.weights.version if self.weights is not None else 0
            return version, self.engine.generate(
                [e.traj.token_ids for e in episodes],
                self.max_new_tokens,
                self.temperature,
                self.top_p,
                [self.chat.end_of_turn_id],
                seeds,
            )

        version, gens = await asyncio.wrap_future(scheduler.submit(generate, self.priority))
        turns = []
        for e, g in zip(episodes, gens):
            ids = g.token_ids[:-1] if g.finished and g.token_ids[-1:] == [self.chat.end_of_turn_id] else g.token_ids
            turns.append(
                Turn(
                    self.chat.decode(ids),
                    g.token_ids,
                    g.logprobs,
                    g.finished,
                    prompt_tokens=len(e.traj.token_ids),
                    completion_tokens=len(g.token_ids),
                    version=version,
                )
            )
        return turns

    async def aclose(self) -> None:
        pass


async def run_episodes(
    tasks: list[TaskRecord],
    policy: TurnPolicy,
    client,
    *,
    samples: int = 1,
    limits: LoopLimits,
    default_preference: dict,
    seed: str = "",
    concurrency: int | None = None,
    progress=None,
    stats: dict | None = None,
) -> list[Trajectory]:
    """``samples`` episodes of each task with ``policy``; trajectory.group = index of its task.

    At most ``concurrency`` episodes are live at once (None: all). Each episode gets its own
    ``meta.seed`` (``seed`` / its index), so the service's random draws (simulated experts) differ
    between the samples of a task, and are the same for two policies run with the same seed; a
    token-level policy's sampled turns draw from it too (``turn_seed``).
    ``stats``, when given, receives the time spent producing turns (``generate_s``), the time the
    policy sat idle waiting for tools (``env_wait_s``) and the policy calls made (``generate_calls``).
    ``progress(done, total)`` is called as episodes end.
    """
    run = _Run(
        [with_default_preference(t, default_preference) for t in tasks],
        samples,
        policy,
        client,
        limits,
        seed,
        progress,
        {} if stats is None else stats,
    )
    return await run.all(concurrency)


class _Run:
    """The state of one ``run_episodes`` call: episodes ready for a turn, tool calls in flight."""

    def __init__(self, tasks, samples, policy, client, limits, seed, progress, stats):
        self.tasks, self.samples, self.policy, self.client, self.limits = tasks, samples, policy, client, limits
        self.seed, self.progress, self.stats = seed, progress, stats
        self.queue = deque(range(len(tasks) * samples))
        self.total, self.finished = len(self.queue), 0
        self.episodes: list[Episode | None] = [None] * self.total
        self.ready: list[Episode] = []
        self.in_flight: set[asyncio.Future] = set()
        stats.update(generate_s=0.0, env_wait_s=0.0, generate_calls=0)

    async def all(self, concurrency: int | None) -> list[Trajectory]:
        first = [self.queue.popleft() for _ in range(min(concurrency or self.total, self.total))]
        try:
            await asyncio.gather(*[self.start(k) for k in first])
            while self.ready or self.in_flight:
                if self.ready:
                    await self.act()
                else:
                    await self.wait_for_tools()
        finally:
            for d in self.in_flight:
                d.cancel()
            await asyncio.gather(
                *[self.client.delete_episode(ep.episode_id) for ep in self.episodes if ep and ep.episode_id],
                return_exceptions=True,
            )
            _first_error(self.in_flight)
        return [ep.traj for ep in self.episodes]

    async def start(self, k: int) -> None:
        group, sample = divmod(k, self.samples)
        task = self.tasks[group]
        record = task.to_dict()
        seed = f"{self.seed}/{k}"
        record["meta"] = {**task.meta, "seed": seed}
        created = await self.client.create_episode(record)
        messages, chat = task_messages(task), self.policy.chat
        transcript = Transcript(chat, messages, created["tools"]) if chat is not None else None
        ids = chat.encode(transcript.text) if transcript is not None else []
        traj = Trajectory(
            task=task,
            group=group,
            token_ids=list(ids),
            loss_mask=[0] * len(ids),
            gen_logprobs=[0.0] * len(ids),
            prompt_len=len(ids),
            messages=messages,
        )
        ep = Episode(
            task,
            group,
            sample,
            created["episode_id"],
            created["tools"],
            messages,
            traj,
            seed=seed,
            transcript=transcript,
        )
        self.episodes[k] = ep
        self.ready.append(ep)

    async def act(self) -> None:
        """The next turn of every ready episode, in one policy call; full contexts end instead."""
        batch = list(self.ready)
        self.ready.clear()  # turn() and finish() append to this list
        for ep in batch:
            if not _fits(ep, self.limits):
                ep.traj.stop_reason = StopReason.CONTEXT
                self.in_flight.add(asyncio.ensure_future(self.finish(ep)))
        batch = [ep for ep in batch if ep.traj.stop_reason != StopReason.CONTEXT]
        if not batch:
            return
        t0 = time.perf_counter()
        turns = await self.policy.act(batch)
        self.stats["generate_s"] += time.perf_counter() - t0
        self.stats["generate_calls"] += 1
        self.in_flight |= {asyncio.ensure_future(self.turn(ep, t)) for ep, t in zip(batch, turns)}

    async def wait_for_tools(self) -> None:
        """All episodes wait for tools: wait for the first call, then up to ``batch_window_s`` for others."""
        t0 = time.perf_counter()
        done, self.in_flight = await asyncio.wait(self.in_flight, return_when=asyncio.FIRST_COMPLETED)
        if self.in_flight and self.limits.batch_window_s > 0:
            more, self.in_flight = await asyncio.wait(self.in_flight, timeout=self.limits.batch_window_s)
            done |= more
        error = _first_error(done)
        if error is not None:  # a tool call that raised ends the run with its error
            raise error
        self.stats["env_wait_s"] += time.perf_counter() - t0

    async def turn(self, ep: Episode, t: Turn) -> None:
        done = await _apply(ep, t, self.client, self.policy.chat)
        if not done and len(ep.traj.turns) >= self.limits.turn_budget(ep.task):
            ep.traj.stop_reason, done = StopReason.MAX_TURNS, True
        if done:
            await self.finish(ep)
        else:
            self.ready.append(ep)

    async def finish(self, ep: Episode) -> None:
        try:
            await _settle(ep, self.client, self.limits)
        finally:
            await self.client.delete_episode(ep.episode_id)
            ep.episode_id = ""
        self.finished += 1
        if self.progress is not None:
            self.progress(self.finished, self.total)
        if self.queue:
            await self.start(self.queue.popleft())


def _first_error(tasks) -> BaseException | None:
    """The first exception of the finished tasks; reading every one keeps asyncio from logging the others
    as never retrieved (a traceback each when a dead tool service fails a whole batch)."""
    errors = [t.exception() for t in tasks if t.done() and not t.cancelled()]
    return next((e for e in errors if e is not None), None)


def _fits(ep: Episode, limits: LoopLimits) -> bool:
    if limits.max_context is None or not ep.traj.token_ids:
        return True
    return len(ep.traj.token_ids) + max(limits.turn_tokens, 1) <= limits.max_context


def call_schema_error(call: ToolCall, tools: list[dict[str, Any]]) -> str | None:
    """Why a call that parsed does not fit the tools the episode offers (a tool not offered, or the
    service's own argument check: a missing or unknown argument, a wrong JSON type, a value outside
    its enum), or None. Such a call is malformed as much as one that does not parse, and
    ``advantage.drop_format_errors`` keeps both out of the loss."""
    schema = next((t["function"] for t in tools if t["function"]["name"] == call.name), None)
    if schema is None:
        return f"no tool named {call.name!r}"
    try:
        check_arguments(call.name, schema.get("parameters") or {}, call.arguments)
    except ToolArgumentError as e:
        return str(e)
    return None


async def _apply(ep: Episode, turn: Turn, client, chat: ChatFormat | None) -> bool:
    """Append one turn, execute its tool calls in order, append their observations. True when the
    episode is done (a call ended it)."""
    t = ep.traj
    if turn.failure is not None:
        t.stop_reason, t.meta["failure"] = StopReason.POLICY_ERROR, turn.failure
        return True
    record = TurnRecord(version=turn.version)  # its cost: its calls' (here) and its own tokens' (_settle)
    t.turns.append(record)
    ep.prompt_tokens += turn.prompt_tokens
    ep.completion_tokens += turn.completion_tokens
    ep.turn_tokens.append((turn.prompt_tokens, turn.completion_tokens))
    if chat is not None:
        record.start = len(t.token_ids)
        t.token_ids += turn.token_ids
        t.loss_mask += [1] * len(turn.token_ids)
        t.gen_logprobs += turn.logprobs
        if not turn.finished:  # close the turn the way the template does, as a non-trained token
            t.token_ids.append(chat.end_of_turn_id)
            t.loss_mask.append(0)
            t.gen_logprobs.append(0.0)
        written = (
            turn.token_ids[:-1] if turn.finished and turn.token_ids[-1:] == [chat.end_of_turn_id] else turn.token_ids
        )
        if chat.encode(turn.text) != written:  # a server re-tokenizes the text: other ids, same text
            t.retokenized_turns += 1
    parsed = _parse(turn, f"call_{len(t.turns)}", chat)
    if ep.transcript is not None:  # the message a server renders back to the ids kept, or the text verbatim
        parsed = ep.transcript.assistant(ep.messages, parsed, turn.text)

    ep.messages.append(parsed.message)
    record.key = turn_key(parsed.calls, ep.tools) if parsed.error is None else FORMAT_ERROR_TURN
    if parsed.error is not None:
        t.format_errors += 1
        t.tool_errors += 1
        ep.messages.append(tool_message(format_error_observation(parsed.error)))
    off_schema = any(call_schema_error(call, ep.tools) is not None for call in parsed.calls)
    t.schema_errors += off_schema
    if chat is not None and (parsed.error is not None or off_schema):
        k = break_index(chat, turn.token_ids, ep.tools)
        if k is not None:  # the token that broke the turn
            record.broken = (record.start + k, record.start + k + 1)
        else:  # no one token did (a turn cut inside its call): the call, its plan left out
            record.broken = (
                record.start + chat.plan_length(turn.text, turn.token_ids),
                record.start + len(turn.token_ids),
            )
    t.plan_errors += misstated_plan(t.task.category, t.task.meta.get("preference_name"), turn.text) is not None
    for call, spec in zip(parsed.calls, parsed.message.get("tool_calls") or []):
        result = await client.step(ep.episode_id, call.name, call.arguments)
        t.call_latencies_s.append(float(result.get("latency_s", 0.0)))
        record.cost += float(result.get("cost", 0.0))
        record.calls += 1
        if call.name == "answer" and not result.get("error"):  # ended a user turn (the last: the episode)
            t.user_turn_ends.append(len(t.turns) - 1)
        if result.get("error"):
            t.tool_errors += 1
        if result.get("done"):
            t.stop_reason = StopReason.ANSWER if call.name == "answer" else StopReason.SERVICE_GUARD
            t.correct = bool((result.get("outcome") or {}).get("correct", False))
            return True
        ep.messages.append(tool_message(str(result.get("observation", "")), spec.get("id")))
    if ep.transcript is not None:
        obs_ids = chat.encode(ep.transcript.observe(ep.messages))
        t.token_ids += obs_ids
        t.loss_mask += [0] * len(obs_ids)
        t.gen_logprobs += [0.0] * len(obs_ids)
    return False


FORMAT_ERROR_TURN = "<malformed>"  # the action of a turn without a valid call, whatever its text


def turn_key(calls, tools: list[dict[str, Any]]) -> str:
    """A turn's action as per-turn credit compares turns (``grpo/advantages.py``): each call's tool and
    arguments, canonical JSON, with free text (a string the tool's schema does not enumerate: an
    expert's query, an answer) as its type: the choice among what the tools offer, not its wording."""
    enums = {
        (t["function"]["name"], k)
        for t in tools
        for k, p in ((t["function"].get("parameters") or {}).get("properties") or {}).items()
        if "enum" in p
    }
    key = [
        [c.name, {k: v if not isinstance(v, str) or (c.name, k) in enums else "<text>" for k, v in c.arguments.items()}]
        for c in calls
    ]
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def _parse(turn: Turn, call_id: str, chat: ChatFormat | None) -> ParsedTurn:
    """The assistant message and calls of ``turn``: as its server returned them, as the policy decided
    them, or read from its text as the serving server's parsers read it."""
    if turn.message is not None:
        return parse_server_message(turn.message, call_id)
    if turn.call is not None:
        return ParsedTurn(tool_call_message(turn.call.name, turn.call.arguments, turn.text, call_id), [turn.call])
    return chat.read_turn(turn.text, call_id) if chat is not None else parse_turn(turn.text, call_id, False)


async def _settle(ep: Episode, client, limits: LoopLimits) -> None:
    """Read the episode's accounting from the service; add the policy's own token cost."""
    status = await client.get_episode(ep.episode_id)
    t = ep.traj
    t.tool_cost = float(status["total_cost"])
    t.latency_s = float(status["total_latency_s"])
    t.tool_counts = {**status.get("tool_counts", {}), **status.get("model_counts", {})}  # tools and expert aliases
    t.policy_cost = (ep.prompt_tokens * limits.price_in + ep.completion_tokens * limits.price_out) / 1e6
    for record, (p, c) in zip(t.turns, ep.turn_tokens):
        record.cost += (p * limits.price_in + c * limits.price_out) / 1e6
    t.meta["episode"] = status
    t.meta["sample"] = ep.sample
    outcome = status.get("outcome") or {}
    if outcome:
        t.correct = bool(outcome.get("correct", False))
        t.user_turn_passed = [bool(p) for p in outcome.get("turn_passed") or []]
    assert len(t.token_ids) == len(t.loss_mask) == len(t.gen_logprobs)
