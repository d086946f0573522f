"""Rollouts that run ahead of training by at most K policy versions (``rollout.steps_ahead=K``).

The trainer's event loop (tool-service client, agent loop) runs in a thread of its own. Before
step s trains, the rollouts of steps s .. s+K are started (those not started yet); step s then
waits only for its own. Meanwhile the engine keeps generating the next steps' turns, and the
trainer's new weights reach it between two generate calls (``EngineWeights.load``), so an
episode in flight continues with the newer policy from its next turn. A rollout of step j starts
once the engine holds version j - K or newer, so every turn trained on at step j was written by
version j - K or newer: at most K versions behind. The loss corrects for the older behaviour
policy with the generator's per-token logprobs (truncated importance sampling, ``loss.tis_cap``).

K = 0 starts step s's rollouts only when step s trains: the synchronous loop's order and results.
A run that stops drops the rollouts in flight; a resumed run regenerates them, in the same data
order (the tasks of step j depend on j only).

``started[j]`` and ``finished[j]`` (``time.perf_counter``) say when step j's rollouts were submitted and
when their coroutine ended (before ``take(j)`` returns); ``take(s)`` forgets those of the steps before s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Callable, Coroutine


class AsyncRollouts:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        rollout: Callable[[int], Coroutine[Any, Any, Any]],
        steps_ahead: int,
        last_step: int,
    ):
        """``rollout(j)``: the coroutine that produces step j's rollouts; steps run up to ``last_step``
        (exclusive)."""
        self.loop, self.rollout, self.steps_ahead, self.last_step = loop, rollout, steps_ahead, last_step
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.started: dict[int, float] = {}
        self.finished: dict[int, float] = {}
        self.thread = threading.Thread(target=loop.run_forever, name="rollouts", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine) -> Any:
        """Run a coroutine on the rollout thread's loop and wait for its result (held-out evaluation)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

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
