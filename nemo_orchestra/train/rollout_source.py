"""A step's rollouts for ``Trainer.grpo_step``: made when the step starts, or up to K steps ahead.

``RolloutSource.take(step)`` gives step ``step``'s rollouts (``StepRollouts``): ``rollout.group_size``
episodes per prompt of the step's data (``DataOrder``) through the agent loop (``Episodes``), each
group rewarded as it comes back (the reward stage: dynamic sampling, ``rollout.fill_informative_groups``,
reads the rewards to decide whether to draw more prompts).

With ``rollout.steps_ahead=K >= 1`` the trainer's event loop (tool-service client, agent loop) runs in a
thread of its own (``RolloutsAhead``). Before step s trains, the rollouts of steps s .. s+K are started
(those not started yet); step s then waits only for its own. Meanwhile the engine keeps generating the
next steps' turns, and the trainer's new weights reach it between two generate calls
(``EngineWeights.load``), so an episode in flight continues with the newer policy from its next turn. A
rollout of step j starts once the engine holds version j - K or newer, so every turn trained on at step
j was written by version j - K or newer: at most K versions behind (``drop_stale`` counts a violation).
The loss corrects for the older behaviour policy with the generator's per-token logprobs (truncated
importance sampling, ``loss.tis_cap``).

K = 0 runs step s's rollouts on the caller's thread when step s takes them: the synchronous loop. A run
that stops drops the rollouts in flight (``stop``); a resumed run regenerates them, in the same data
order (the tasks of step j depend on j only).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine

from nemo_orchestra.config import RolloutConfig
from nemo_orchestra.grpo.advantages import informative_groups
from nemo_orchestra.megatron.parallel import model_parallel_rank
from nemo_orchestra.prompting.chat import ChatFormat
from nemo_orchestra.rollout.loop import HELDOUT_SEED, EnginePolicy, LoopLimits, run_episodes
from nemo_orchestra.rollout.managed_engine import ManagedEngine
from nemo_orchestra.train.data_order import DataOrder
from nemo_orchestra.types import TaskRecord, Trajectory
from tools_env.recovery import tool_service_context, with_tool_service


@dataclass
class StepRollouts:
    """One step's rollouts (rewarded), the engine's timings (``generate_s``, ``env_wait_s``,
    ``generate_calls``, ``prompts_drawn``, ``wall_s``) and when they ran (``time.perf_counter``)."""

    trajectories: list[Trajectory]
    stats: dict = field(default_factory=dict)
    waited_s: float = 0.0  # the trainer's wait for them
    started_at: float = 0.0
    finished_at: float = 0.0


@dataclass
class Episodes:
    """Episodes of given tasks through the agent loop, the run's engine as the policy."""

    rollout: RolloutConfig
    default_preference: dict
    generation: ManagedEngine  # the generation engine, from its start to its close
    chat: ChatFormat
    client: object  # tools_env client
    loop: asyncio.AbstractEventLoop
    output_dir: str  # the run's folder, named by a tool service's stop line

    async def play(
        self,
        tasks: list[TaskRecord],
        samples: int,
        temperature: float,
        seed: str,
        stats: dict | None = None,
        priority: float = -math.inf,
    ) -> list[Trajectory]:
        """``priority``: the place of their engine calls (``EngineThread``): the step, for a step's
        rollouts (the oldest step's go first); -inf for calls the trainer waits on now."""
        r = self.rollout
        policy = EnginePolicy(
            self.generation.engine,
            self.chat,
            r.max_new_tokens_per_turn,
            temperature,
            r.top_p,
            weights=self.generation.weights,
            priority=priority,
            seed_per_turn=r.seed_per_turn,
        )
        return await run_episodes(
            tasks,
            policy,
            self.client,
            samples=samples,
            limits=LoopLimits.from_rollout(r),
            default_preference=self.default_preference,
            seed=seed,
            stats=stats,
        )

    def run(self, tasks: list[TaskRecord], samples: int, temperature: float, seed: str, step: int) -> list[Trajectory]:
        """``play`` to its end on this thread's loop, at ``step`` (steps done so far, for a stop line)."""
        coro = lambda: self.loop.run_until_complete(self.play(tasks, samples, temperature, seed))  # noqa: E731
        return self.with_service(coro, step, heldout=seed == HELDOUT_SEED)

    def with_service(self, fn: Callable[[], Any], step: int, heldout: bool = False) -> Any:
        """``fn()``, the tool service restarted and ``fn`` redone once if it dies (``tools_env/recovery.py``)."""
        return with_tool_service(fn, self.client, **tool_service_context(self.output_dir, step, heldout))


def on_rollout_rank(generation: ManagedEngine, fn: Callable[[], Any]) -> Any:
    """``fn()`` (rollouts) on this replica's first model-parallel rank; None on the others.

    An engine whose forward spans the tensor-parallel group (rollout.engine=megatron at TP > 1)
    has the other ranks serve its generate calls meanwhile, until the first rank releases them.
    """
    spans = generation.spans_tensor_parallel_group
    if model_parallel_rank() != 0:
        if spans:
            generation.engine.serve()
        return None
    try:
        return fn()
    finally:
        if spans:
            generation.engine.release()


@dataclass
class RolloutSource:
    episodes: Episodes
    order: DataOrder  # which prompts a step draws
    reward: Callable[[list[Trajectory]], None]  # fills each trajectory's reward, group by group
    min_group_std: float  # advantage.min_group_std: a group above it is informative (dynamic sampling)
    seed: int  # run.seed
    steps_ahead: int  # K (RunPlan.rollouts_ahead)
    last_step: int  # trainer.max_steps: no rollouts started for steps from it on
    background: bool = False  # rollouts on a thread of their own (K >= 1; at K = 0 the same order as without)
    ahead: RolloutsAhead | None = None  # that thread, from the first take to ``stop``

    @property
    def rollout(self) -> RolloutConfig:
        return self.episodes.rollout

    async def produce(self, step: int) -> tuple[list[Trajectory], dict]:
        """Step ``step``'s rollouts (group_size per prompt), each with its reward, and the engine's
        timings; with ``rollout.fill_informative_groups``, more prompts until the step has
        ``data.prompts_per_step`` groups whose rewards differ (DAPO's dynamic sampling), at most
        ``rollout.max_extra_prompts``. Rewards are computed once, here, as each group comes back."""
        r = self.rollout
        seed = f"{self.seed}/{step}/{self.order.dp_rank}"
        tasks = self.order.tasks_at(step)
        stats: dict = {}
        t0 = time.perf_counter()
        trajs = await self.episodes.play(tasks, r.group_size, r.temperature, seed, stats, priority=step)
        self.reward(trajs)
        drawn = await self.fill_informative_groups(tasks, trajs, seed, stats, step) if r.fill_informative_groups else 0
        stats["prompts_drawn"] = len(tasks) + drawn
        stats["wall_s"] = time.perf_counter() - t0
        return trajs, stats

    async def fill_informative_groups(
        self, tasks: list[TaskRecord], trajs: list[Trajectory], seed: str, stats: dict, step: int
    ) -> int:
        """More prompts (appended to ``trajs``, their timings to ``stats``) until ``data.prompts_per_step``
        groups are informative or ``rollout.max_extra_prompts`` are drawn; returns how many were drawn.
        The extra prompts are a fixed draw per step, so the data order holds."""
        r, n = self.rollout, self.order.prompts_per_step
        used = {t.id for t in tasks}
        pool = [t for t in self.order.tasks if t.id not in used]
        random.Random(f"{seed}/extra").shuffle(pool)
        drawn = 0
        while drawn < min(r.max_extra_prompts, len(pool)):
            need = n - len(informative_groups(trajs, self.min_group_std))
            if need <= 0:
                break
            extra = pool[drawn : drawn + min(need, r.max_extra_prompts - drawn)]
            more_stats: dict = {}
            more = await self.episodes.play(
                extra, r.group_size, r.temperature, f"{seed}/extra{drawn}", more_stats, priority=step
            )
            offset = max(t.group for t in trajs) + 1
            for t in more:
                t.group += offset
            self.reward(more)
            trajs += more
            drawn += len(extra)
            for k, v in more_stats.items():
                stats[k] += v
        return drawn

    def take(self, step: int) -> StepRollouts:
        """Step ``step``'s rollouts, their engine timings and the seconds the trainer waited for them."""
        if not self.background:
            t0 = time.perf_counter()
            run = lambda: self.episodes.loop.run_until_complete(self.produce(step))  # noqa: E731
            trajs, stats = self.episodes.with_service(run, step)
            t1 = time.perf_counter()
            return StepRollouts(trajs, stats, t1 - t0, t0, t1)
        if self.ahead is None:
            self.ahead = RolloutsAhead(self.episodes.loop, lambda j: self.produce(j), self.steps_ahead, self.last_step)
        (trajs, stats), waited = self.episodes.with_service(lambda: self.ahead.take(step), step)
        return StepRollouts(trajs, stats, waited, self.ahead.started[step], self.ahead.finished[step])

    def stop(self) -> None:
        """Drop the rollouts in flight for later steps; the event loop is this thread's again."""
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None


def drop_stale(trajs: list[Trajectory], step: int, steps_ahead: int) -> tuple[list[Trajectory], dict[str, float]]:
    """Trajectories whose oldest turn is at most ``steps_ahead`` versions behind step ``step``'s policy
    (all of them, by construction: a violation is counted, and the trajectory not trained on)."""
    lags = [step - min((r.version for r in t.turns), default=step) for t in trajs]
    kept = [t for t, lag in zip(trajs, lags) if lag <= steps_ahead]
    return kept, {
        "rollout/staleness_mean": statistics.fmean(lags) if lags else 0.0,
        "rollout/staleness_max": float(max(lags, default=0)),
        "rollout/stale_dropped": float(len(trajs) - len(kept)),
    }


class RolloutsAhead:
    """Step j's rollouts (``rollout(j)``, a coroutine) run on ``loop`` in a thread of its own, up to
    ``steps_ahead`` steps before step j is taken, for steps below ``last_step``.

    ``started[j]`` and ``finished[j]`` (``time.perf_counter``) say when step j's rollouts were submitted
    and when their coroutine ended (before ``take(j)`` returns); ``take(s)`` forgets those of the steps
    before s."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        rollout: Callable[[int], Coroutine[Any, Any, Any]],
        steps_ahead: int,
        last_step: int,
    ):
        self.loop, self.rollout, self.steps_ahead, self.last_step = loop, rollout, steps_ahead, last_step
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.started: dict[int, float] = {}
        self.finished: dict[int, float] = {}
        self.thread = threading.Thread(target=loop.run_forever, name="rollouts", daemon=True)
        self.thread.start()

    def take(self, step: int) -> tuple[Any, float]:
        """Step ``step``'s rollouts (started now if not already) and the seconds spent waiting for them;
        first starts those of the steps up to ``step + steps_ahead``."""
        for j in range(step, min(step + self.steps_ahead, self.last_step - 1) + 1):
            if j not in self.pending:
                self.started[j] = time.perf_counter()
                self.pending[j] = asyncio.run_coroutine_threadsafe(self._timed(j), self.loop)
        for j in [j for j in self.pending if j < step]:  # left by a failed step: never trained on
            self.pending.pop(j).cancel()
        for times in (self.started, self.finished):
            for j in [j for j in times if j < step]:
                del times[j]
        t0 = time.perf_counter()
        future = self.pending.pop(step)
        return future.result(), time.perf_counter() - t0

    async def _timed(self, step: int) -> Any:
        try:
            return await self.rollout(step)
        finally:  # before the future completes: take() reads it once the result is there
            self.finished[step] = time.perf_counter()

    def close(self) -> None:
        """Cancel the rollouts in flight, stop the loop and its thread; the loop is the caller's again."""
        if not self.thread.is_alive():
            return

        async def drain():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(drain(), self.loop).result(timeout=60)
        finally:
            self.pending.clear()
            self.started.clear()
            self.finished.clear()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=60)
