"""The run's generation engine from its start to its close, in one place (``ManagedEngine``).

- **start**: an engine that reads the policy's own parameters (``reads_policy_weights``) starts when
  the run is built, so that a layout it cannot serve stops the run before the warm start; any other
  starts at the first weight sync, from the weights of that moment (after the warm start, or from a
  resumed checkpoint), so that an engine with processes of its own (vLLM) does not compete with the
  warm start for CPU.
- **sync**: the policy's weights pushed between two generate calls (``EngineWeights.load``); every
  turn records the version that wrote it. An engine that reads the policy's parameters gets nothing.
- **sleep / wake_up**: the engine's GPU memory is the trainer's between a step's rollouts and its
  weight sync (vLLM's sleep mode on CUDA); not while rollouts run ahead, which generate meanwhile.
- **close**: once, whatever happened before; a generate call still running ends within
  ``CALL_GRACE_S``.

``calls`` records when the engine's generate calls ran (``GenerateCalls``), whoever made them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

from nemo_orchestra.rollout.engines.base import GenerationEngine
from nemo_orchestra.rollout.scheduler import EngineWeights, stop_engine_calls

log = logging.getLogger(__name__)

# how long closing waits for a generate call in flight to return once its engine is closed (a closed
# in-process engine ends it at its next token; vLLM's fails when its processes end)
CALL_GRACE_S = 30.0


class ManagedEngine:
    def __init__(
        self,
        factory: Callable[[dict | None], GenerationEngine] | None = None,
        engine: GenerationEngine | None = None,
        reads_policy_weights: bool = False,
    ):
        """``factory(state)`` starts the engine from a full state dict (None: the policy's own
        parameters). With ``reads_policy_weights`` it is started now."""
        self.factory = factory
        self.calls = GenerateCalls()
        self.engine = self.calls.watch(engine) if engine is not None else None
        self.weights = EngineWeights()  # the version of the engine's weights
        if self.engine is None and reads_policy_weights:
            self.engine = self._start(None)

    def _start(self, state: dict | None) -> GenerationEngine:
        if self.factory is None:
            raise RuntimeError("the generation engine has no factory to start it from")
        return self.calls.watch(self.factory(state))

    @property
    def reads_policy_weights(self) -> bool:
        return self.engine is not None and self.engine.capabilities.reads_policy_weights

    @property
    def spans_tensor_parallel_group(self) -> bool:
        return self.engine is not None and self.engine.capabilities.spans_tensor_parallel_group

    def sync(self, full_state: Callable[[], dict], version: int) -> float:
        """The policy's weights after ``version`` GRPO steps into the engine (started now if it is not
        yet); its seconds. ``full_state()`` gathers the weights from every shard: every rank calls
        this, whether or not it holds the engine."""
        t0 = time.perf_counter()
        if self.reads_policy_weights:  # nothing to gather or push
            self.weights.version = version
            return time.perf_counter() - t0
        state = full_state()
        if self.engine is None:
            self.engine = self._start(state)
            self.weights.version = version
        else:
            self.weights.load(self.engine, state, version)
        return time.perf_counter() - t0

    def memory(self, action: str, rollouts_ahead: bool) -> float:
        """``engine.sleep()`` or ``engine.wake_up()``; its seconds. Nothing while rollouts run ahead
        of training (``rollouts_ahead``): the engine is generating the next steps' turns meanwhile."""
        t0 = time.perf_counter()
        if self.engine is not None and not rollouts_ahead:
            {"sleep": self.engine.sleep, "wake_up": self.engine.wake_up}[action]()
        return time.perf_counter() - t0

    def close(self) -> None:
        """The engine closed (its processes ended), then the engine calls still waiting dropped and
        the running one waited for."""
        try:
            if self.engine is not None:
                self.engine.close()  # a generate call still running (rollouts ahead, a stop) ends soon
        finally:
            if not stop_engine_calls(CALL_GRACE_S):
                log.warning("a generation engine call was still running %.0f s after the engine closed", CALL_GRACE_S)


class GenerateCalls:
    """When generate calls ran: (start, end, sequences) of the latest ``keep`` calls that returned (or
    raised), ``clock()`` times, and the starts of those running now. Calls may overlap; any thread may
    make them."""

    def __init__(self, keep: int = 1 << 16, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._lock = threading.Lock()
        self._done: deque[tuple[float, float, int]] = deque(maxlen=keep)
        self._running: dict[int, float] = {}
        self._ids = itertools.count()
        self._dropped = False  # an older call fell out of ``_done``

    @contextmanager
    def call(self, sequences: int = 0) -> Iterator[None]:
        """Records the block as one call of ``sequences`` prompts."""
        key = next(self._ids)
        with self._lock:
            self._running[key] = self.clock()
        try:
            yield
        finally:
            with self._lock:
                self._dropped |= len(self._done) == self._done.maxlen
                self._done.append((self._running.pop(key), self.clock(), sequences))

    def watch(self, engine):
        """``engine`` with its ``generate`` recorded (the instance's attribute wraps the method)."""
        generate = engine.generate

        def recorded(prompts, *args, **kwargs):
            with self.call(len(prompts)):
                return generate(prompts, *args, **kwargs)

        engine.generate = recorded
        return engine

    def _since(self, start: float) -> tuple[list[tuple[float, float, int]], list[float]] | None:
        """The calls kept (returned, running) if every call that may have run from ``start`` on is among
        them; else None."""
        with self._lock:
            done = list(self._done)
            if self._dropped and (not done or done[0][0] > start):
                return None
            return done, list(self._running.values())

    def busy_s(self, start: float, end: float) -> float | None:
        """Seconds of ``[start, end]`` in which at least one call ran (the union of the calls' intervals,
        those still running up to ``end``); None when calls that may have run then are no longer kept."""
        kept = self._since(start)
        if kept is None:
            return None
        done, running = kept
        clipped = ((max(a, start), min(b, end)) for a, b, _ in done + [(a, end, 0) for a in running])
        spans = sorted((a, b) for a, b in clipped if b > a)
        busy, reach = 0.0, start
        for a, b in spans:
            if b > reach:
                busy += b - max(a, reach)
                reach = b
        return busy

    def started_in(self, start: float, end: float) -> tuple[int, int] | None:
        """The calls that returned and started within ``[start, end]``, and their sequences; None when
        calls that may have started then are no longer kept."""
        kept = self._since(start)
        if kept is None:
            return None
        inside = [n for a, _, n in kept[0] if start <= a <= end]
        return len(inside), sum(inside)
