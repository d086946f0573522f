"""The engine scheduler: the one thread that drives the generation engines, and the version of the weights
an engine holds.

Every engine call of a process (the agent loop's generate calls, the trainer's weight loads) runs on
one thread (vLLM's client sockets are not thread-safe), where work waits by priority: calls someone
is blocked on right now (a weight load, held-out evaluation) first, then the rollouts of the oldest
step. ``EngineWeights`` loads weights on that thread between two generate calls, so each turn knows
the version that wrote it.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import math
import threading

from nemo_orchestra.rollout.engines.base import GenerationEngine


class EngineThread:
    """The one thread that drives the generation engines (vLLM's client sockets are not thread-safe).

    Work waits in order of ``priority`` (lower first), then of submission; work already running is
    never interrupted. Calls someone is blocked on right now (a weight load, held-out evaluation)
    come first, then the rollouts of the oldest step: with rollouts ahead of training, step s + 1's
    next turn would otherwise queue behind step s + 2's call, and the trainer, waiting for s + 1,
    for both."""

    def __init__(self, name: str):
        self.name = name
        self._queue: list = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False  # a call is running

    def submit(self, fn, priority: float = -math.inf) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
            heapq.heappush(self._queue, (priority, next(self._order), fn, future))
            self._wake.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._queue:
                    self._wake.wait()
                _, _, fn, future = heapq.heappop(self._queue)
                if not future.set_running_or_notify_cancel():  # its caller gave up on it while it waited
                    continue
                self._busy = True
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def cancel_and_wait(self, timeout: float) -> bool:
        """Cancel the calls still waiting and wait for the one running to return (its engine closed, it
        ends soon). False if it is still running after ``timeout`` seconds. A process must not exit
        while an engine call runs on this (daemon) thread: torch's threads then abort the process."""
        with self._wake:
            for *_, future in self._queue:
                future.cancel()
            self._queue.clear()
            return self._wake.wait_for(lambda: not self._busy, timeout)


_ENGINE_THREAD = EngineThread("rollout-engine")


def submit(fn, priority: float = -math.inf) -> concurrent.futures.Future:
    """Run ``fn()`` on the engine thread, after the waiting work of lower ``priority`` (-inf: a caller
    that waits now; the step, for rollouts ahead of training)."""
    return _ENGINE_THREAD.submit(fn, priority)


def stop_engine_calls(timeout: float = 30.0) -> bool:
    """After the engine's ``close``: drop the engine calls still waiting and wait for the running one
    to return; False if it has not after ``timeout`` seconds."""
    return _ENGINE_THREAD.cancel_and_wait(timeout)


class EngineWeights:
    """The version of the weights a generation engine holds (the policy's optimizer steps when they
    were loaded). Loads run on the engine thread, between generate calls: rollouts in flight go on
    with the new weights from their next turn, and each turn records the version that wrote it."""

    def __init__(self, version: int = 0):
        self.version = version

    def load(self, engine: GenerationEngine, state: dict, version: int) -> None:
        """``engine.load_weights(state)`` after the generate call running now, before any that waits;
        the version then becomes ``version``."""

        def load():
            engine.load_weights(state)
            self.version = version

        submit(load).result()
