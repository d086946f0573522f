"""Episodes: creation from a task record, tool steps under guards, expiry, and summaries.

An episode lives in one service process. Its steps serialize on a per-episode ``asyncio.Lock``;
every step is a turn, whether the call was valid or not. Bad calls from the policy (unknown
tool, bad arguments, a tool that fails or raises) become error observations; only transport
level mistakes (unknown episode, finished episode, bad task record) are ``ServiceError``s that
the server turns into structured 4xx responses.

Guards (``config.guards``), checked after each step: ``max_turns`` turns without an answer,
total cost above ``max_cost`` dollars, or more than ``max_wall_s`` seconds since creation (a
running tool call is cut off at that point) end the episode with ``done=true`` and an incorrect
outcome whose reason names the guard. Episodes idle for ``ttl_s`` expire: they are dropped with
their workdir and leave a small tombstone so ``GET`` can still say "expired".

Workdirs: ``ctx.workdir`` is ``<service temp root>/<episode id>``; it is not created up front
(most episodes never touch disk, and a mkdir is a filesystem call each would pay): a tool that
writes files creates it (``os.makedirs(ctx.workdir, exist_ok=True)``). It is removed when the
episode ends, is deleted or expires, and the whole root when the service stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import secrets
import shutil
import sys
import tempfile
import weakref
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tools_env.service_config import ServiceConfig
from tools_env.prometheus import UNKNOWN_TOOL, Metrics
from tools_env.schema import EPISODE_ID_PATTERN
from tools_env.task import TaskRecord, TaskRecordError
from tools_env.tools.base import EpisodeContext, Tool, ToolArgumentError, ToolResult
from tools_env.verify import USER_REQUIRED, Outcome, UnknownVerifierError, get_verifier, verifier_type

log = logging.getLogger(__name__)

EPISODE_ID_RE = re.compile(EPISODE_ID_PATTERN.strip("^$"))
MAX_TOMBSTONES = 10_000


class ServiceError(Exception):
    """A request the service refuses; becomes ``{"error": {"code", "message"}}`` with ``status``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(eq=False)
class Episode:
    id: str
    task: TaskRecord
    ctx: EpisodeContext
    tools: dict[str, Tool]  # the task's subset, in the record's order
    created: float  # time.monotonic()
    last_active: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    status: str = "active"  # active | done | expired | deleted
    turns: int = 0
    total_cost: float = 0.0
    total_latency_s: float = 0.0
    tool_counts: dict[str, int] = field(default_factory=dict)  # calls of tools in the subset
    model_counts: dict[str, int] = field(default_factory=dict)  # expert calls by alias
    error_count: int = 0
    # a simulated user's totals (conversational tasks): its time, price and tokens, none of them the policy's
    user: dict[str, float] = field(
        default_factory=lambda: {"cost": 0.0, "latency_s": 0.0, "tokens_in": 0, "tokens_out": 0}
    )
    ended_by: str | None = None  # "answer" or the guard's name
    outcome: Outcome | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "episode_id": self.id,
            "task_id": self.task.id,
            "status": self.status,
            "turns": self.turns,
            "total_cost": self.total_cost,
            "total_latency_s": self.total_latency_s,
            "tool_counts": dict(self.tool_counts),
            "model_counts": dict(self.model_counts),
            "error_count": self.error_count,
            "user": dict(self.user),
            "ended_by": self.ended_by,
            "outcome": self.outcome.to_dict() if self.outcome else None,
            "age_s": time.monotonic() - self.created,
        }


def _error_result(message: str) -> ToolResult:
    return ToolResult(observation=f"error: {message}", error=message)


class EpisodeStore:
    def __init__(self, cfg: ServiceConfig, tools: dict[str, Tool], metrics: Metrics, worker_index: int = 0):
        self.cfg, self.guards, self.tools, self.metrics = cfg, cfg.guards, tools, metrics
        self.worker_index = worker_index
        self.root = tempfile.mkdtemp(prefix=f"tools_env-w{worker_index}-", dir=cfg.workdir_root)
        os.chmod(self.root, 0o711)  # the sandbox's dropped uid must traverse it; nobody may list it
        # removed at close(), or when a store nobody closed is collected or the process exits
        self._remove_root = weakref.finalize(self, shutil.rmtree, self.root, True)
        self.episodes: dict[str, Episode] = {}
        self.tombstones: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._pending_rm: set[asyncio.Future] = set()

    # ---- lifecycle -------------------------------------------------------------------------

    def create(self, record: Any, episode_id: str | None = None) -> tuple[Episode, list[dict[str, Any]]]:
        if len(self.episodes) >= self.guards.max_episodes:
            raise ServiceError(
                503,
                "too_many_episodes",
                f"this process already holds {len(self.episodes)} live episodes (guards.max_episodes)",
            )
        try:
            task = TaskRecord.from_dict(record)
        except (TaskRecordError, TypeError) as e:
            raise ServiceError(400, "bad_task", str(e)) from None
        try:  # first: an unavailable verifier type says what to install, before its tools are missed
            get_verifier(verifier_type(task))
        except UnknownVerifierError as e:
            raise ServiceError(400, "unknown_verifier", str(e)) from None
        if verifier_type(task) in USER_REQUIRED and self.cfg.user is None:
            raise ServiceError(400, "no_user", USER_REQUIRED[verifier_type(task)])
        for name in task.tools:
            if name not in self.tools:
                raise ServiceError(
                    400,
                    "unknown_tool",
                    f"unknown tool '{name}' in the task record; tools of this service: {', '.join(self.tools)}",
                )
        if episode_id is None:
            episode_id = f"w{self.worker_index}-{secrets.token_hex(8)}"
        elif not EPISODE_ID_RE.fullmatch(episode_id):
            raise ServiceError(
                400, "bad_episode_id", "episode_id must be 1-64 characters of [A-Za-z0-9_.-], not starting with '.'"
            )
        if episode_id in self.episodes or episode_id in self.tombstones:
            raise ServiceError(409, "episode_exists", f"episode '{episode_id}' already exists")
        workdir = os.path.join(self.root, episode_id)  # created by the first tool that needs it
        rng = random.Random(f"{self.cfg.seed}|{task.id}|{task.meta.get('seed', '')}")
        ctx = EpisodeContext(episode_id=episode_id, task=task, workdir=workdir, rng=rng)
        now = time.monotonic()
        ep = Episode(episode_id, task, ctx, {n: self.tools[n] for n in task.tools}, now, now)
        schemas = [tool.schema(ctx) for tool in ep.tools.values()]
        self.episodes[episode_id] = ep
        self.metrics.episodes_created += 1
        return ep, schemas

    def lookup(self, episode_id: str) -> dict[str, Any]:
        ep = self.episodes.get(episode_id)
        if ep is not None:
            return ep.summary()
        if episode_id in self.tombstones:
            return self.tombstones[episode_id]
        raise self._not_found(episode_id)

    async def delete(self, episode_id: str) -> dict[str, Any]:
        ep = self.episodes.pop(episode_id, None)
        if ep is None:
            if episode_id in self.tombstones:
                return self.tombstones.pop(episode_id)
            raise self._not_found(episode_id)
        summary = ep.summary()
        ep.status = "deleted"  # steps queued on the lock see this and answer 404
        async with ep.lock:  # let a running step finish before its workdir goes
            self._remove_workdir(ep)
        self.metrics.episodes_deleted += 1
        return summary

    def collect_garbage(self, now: float | None = None) -> int:
        """Expire idle episodes and end those past ``max_wall_s``; returns how many expired."""
        now = time.monotonic() if now is None else now
        expired = 0
        for ep in list(self.episodes.values()):
            if ep.lock.locked():
                continue
            if now - ep.last_active > self.guards.ttl_s:
                self._expire(ep)
                expired += 1
            elif ep.status == "active" and now - ep.created > self.guards.max_wall_s:
                self._finish(ep, "max_wall_s", self._guard_outcome(ep, "max_wall_s"))
        return expired

    async def run_gc(self) -> None:
        while True:
            await asyncio.sleep(self.guards.gc_interval_s)
            try:
                self.collect_garbage()
            except Exception:  # the collector must outlive any single bad episode
                log.exception("episode garbage collection failed")

    async def close(self) -> None:
        if self._pending_rm:
            await asyncio.gather(*self._pending_rm, return_exceptions=True)
        self._remove_root()

    # ---- steps ---------------------------------------------------------------------------

    async def step(self, episode_id: str, name: Any, arguments: Any) -> dict[str, Any]:
        ep = self.episodes.get(episode_id)
        if ep is None:
            raise self._gone_or_not_found(episode_id)
        async with ep.lock:
            if ep.status != "active":
                raise self._not_active(ep)
            t0 = time.perf_counter()
            now = time.monotonic()
            ep.last_active = now
            remaining = self.guards.max_wall_s - (now - ep.created)
            if remaining <= 0:
                outcome = self._guard_outcome(ep, "max_wall_s")
                self._finish(ep, "max_wall_s", outcome)
                return {
                    "observation": f"Episode ended: {outcome.reason}.",
                    "cost": 0.0,
                    "latency_s": 0.0,
                    "done": True,
                    "error": "guard: max_wall_s",
                    "outcome": outcome.to_dict(),
                }
            ep.turns += 1
            ep.ctx.turn = ep.turns
            result, label = await self._run_tool(ep, name, arguments, remaining)
            return self._account(ep, result, label, t0)

    async def _run_tool(self, ep: Episode, name: Any, arguments: Any, remaining: float) -> tuple[ToolResult, str]:
        if not isinstance(name, str):
            return _error_result("a tool call needs a string 'name'"), UNKNOWN_TOOL
        tool = ep.tools.get(name)
        if tool is None:
            label = name if name in self.tools else UNKNOWN_TOOL
            return _error_result(
                f"no tool named {name[:80]!r} in this task; available tools: {', '.join(ep.tools) or 'none'}"
            ), label
        if isinstance(arguments, str):  # OpenAI-style tool calls carry arguments as a JSON string
            arguments = _parse_arguments(arguments)
        try:
            args = tool.check_arguments(arguments)
            result = await _with_deadline(tool.call(args, ep.ctx), remaining)
        except ToolArgumentError as e:
            return _error_result(str(e)), name
        except _WallTimeout:
            return _error_result(
                f"{name}: cut off by the episode's max_wall_s guard ({self.guards.max_wall_s:g}s)"
            ), name
        except Exception as e:  # a tool bug is the policy's observation, never a lost episode
            log.exception("tool %s raised", name)
            return _error_result(f"{name}: internal tool error: {type(e).__name__}: {e}"), name
        if not isinstance(result, ToolResult):
            return _error_result(f"{name}: internal tool error: returned {type(result).__name__}"), name
        return result, name

    def _account(self, ep: Episode, result: ToolResult, label: str, t0: float) -> dict[str, Any]:
        if type(result.observation) is not str or type(result.cost) is not float:  # a plug-in's loose types
            result.observation, result.cost = str(result.observation), float(result.cost)
            result.latency_s = float(result.latency_s)
            result.error = None if result.error is None else str(result.error)
        ep.total_cost += result.cost
        ep.total_latency_s += result.latency_s
        if result.error is None and not result.done:  # what tools returned, for tools that read the episode
            ep.ctx.state.setdefault("transcript", []).append((label, result.observation))
            if "stated" in result.meta:  # ToolResult.meta["stated"]
                ep.ctx.state.setdefault("stated", []).append((label, str(result.meta["stated"])))
        if label in ep.tools:
            ep.tool_counts[label] = ep.tool_counts.get(label, 0) + 1
            model = result.meta.get("model")
            if model:
                ep.model_counts[model] = ep.model_counts.get(model, 0) + 1
        if result.error is not None:
            ep.error_count += 1
        user = result.meta.get("user")
        if isinstance(user, dict):  # the simulated user's turn (tools_env.tools.answer)
            usage = user.get("usage") or {}
            ep.user["cost"] += float(user.get("cost") or 0.0)
            ep.user["latency_s"] += float(user.get("latency_s") or 0.0)
            ep.user["tokens_in"] += int(usage.get("prompt_tokens") or 0)
            ep.user["tokens_out"] += int(usage.get("completion_tokens") or 0)
        response = {
            "observation": result.observation,
            "cost": result.cost,
            "latency_s": result.latency_s,
            "done": False,
            "error": result.error,
        }
        if result.done:
            outcome = result.meta.get("outcome")
            if not isinstance(outcome, Outcome):
                outcome = Outcome(False, 0.0, f"{label} ended the episode without an outcome")
            self._finish(ep, "answer", outcome)
            self.metrics.outcomes[outcome.correct] += 1
        else:
            guard = self._tripped_guard(ep)
            if guard is not None:
                self._finish(ep, guard, self._guard_outcome(ep, guard))
        if ep.status == "done":
            response["done"] = True
            response["outcome"] = ep.outcome.to_dict()
        self.metrics.record_step(
            label, result.cost, result.latency_s, result.error is not None, time.perf_counter() - t0
        )
        return response

    # ---- guards and endings ----------------------------------------------------------------

    def _tripped_guard(self, ep: Episode) -> str | None:
        g = self.guards
        if ep.turns >= g.max_turns:
            return "max_turns"
        if ep.total_cost > g.max_cost:
            return "max_cost"
        if time.monotonic() - ep.created > g.max_wall_s:
            return "max_wall_s"
        return None

    def _guard_outcome(self, ep: Episode, guard: str) -> Outcome:
        g = self.guards
        detail = {
            "max_turns": f"{ep.turns} turns reached the limit of {g.max_turns} without an answer",
            "max_cost": f"total cost ${ep.total_cost:.6f} exceeded the limit of ${g.max_cost:g}",
            "max_wall_s": f"{time.monotonic() - ep.created:.1f}s exceeded the limit of {g.max_wall_s:g}s",
        }[guard]
        return Outcome(False, 0.0, f"guard {guard}: {detail}")

    def _finish(self, ep: Episode, how: str, outcome: Outcome) -> None:
        ep.status, ep.ended_by, ep.outcome = "done", how, outcome
        self.metrics.episodes_finished[how] += 1
        self._remove_workdir(ep)

    def _expire(self, ep: Episode) -> None:
        del self.episodes[ep.id]
        summary = ep.summary()
        summary["status"] = ep.status = "expired"
        self.tombstones[ep.id] = summary
        while len(self.tombstones) > MAX_TOMBSTONES:
            self.tombstones.popitem(last=False)
        self._remove_workdir(ep)
        self.metrics.episodes_expired += 1

    def _remove_workdir(self, ep: Episode) -> None:
        path = ep.ctx.workdir
        try:
            os.rmdir(path)  # the common case: nothing was written
        except FileNotFoundError:
            pass
        except OSError:
            fut = asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, path, True)
            self._pending_rm.add(fut)
            fut.add_done_callback(self._pending_rm.discard)

    # ---- errors ----------------------------------------------------------------------------

    def _not_found(self, episode_id: str) -> ServiceError:
        msg = f"no episode '{episode_id[:80]}'"
        m = re.match(r"w(\d+)-", episode_id)
        if m and int(m.group(1)) != self.worker_index:
            msg += (
                f"; its id says worker {m.group(1)} created it but this is worker {self.worker_index} "
                "(route requests by episode id, see tools_env/README.md)"
            )
        return ServiceError(404, "episode_not_found", msg)

    def _gone_or_not_found(self, episode_id: str) -> ServiceError:
        if episode_id in self.tombstones:
            return ServiceError(
                410, "episode_expired", f"episode '{episode_id}' expired after {self.guards.ttl_s:g}s idle"
            )
        return self._not_found(episode_id)

    def _not_active(self, ep: Episode) -> ServiceError:
        if ep.status == "done":
            return ServiceError(
                409, "episode_done", f"episode '{ep.id}' is done (ended by {ep.ended_by}); create a new episode"
            )
        if ep.status == "expired":
            return self._gone_or_not_found(ep.id)
        return self._not_found(ep.id)


def _parse_arguments(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text  # check_arguments reports "must be a JSON object"


class _WallTimeout(Exception):
    pass


if sys.version_info >= (3, 11):

    async def _with_deadline(coro: Any, seconds: float) -> Any:
        try:
            async with asyncio.timeout(seconds) as cm:
                return await coro
        except TimeoutError:
            if cm.expired():
                raise _WallTimeout from None
            raise

else:  # pragma: no cover - Python 3.10

    async def _with_deadline(coro: Any, seconds: float) -> Any:
        try:
            return await asyncio.wait_for(coro, seconds)
        except asyncio.TimeoutError:
            raise _WallTimeout from None
