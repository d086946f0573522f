"""Continuous batching: generate calls join the batch an engine is already running.

A batched ``generate`` call returns when its longest sequence ends, and the agent loop cannot start
another until it does: an episode whose tool returns meanwhile waits for the whole call, and the
engine spends the call's last decode steps on a few sequences. An engine that steps its requests
one decode step at a time (vLLM's ``LLMEngine``: ``add_request``, ``step``) can instead take new
requests at every step. ``ContinuousBatcher`` drives such an engine from one thread of its own:

- ``submit(prompts, params, on_admit)`` queues one call's prompts and returns a future; the
  stepping thread adds them to the engine before its next step, so they decode beside the
  sequences already running. The future's result is ``(on_admit(), generations)``, with
  ``on_admit`` called on the stepping thread at the moment the prompts are added (the version of
  the weights that will write them, for the agent loop).
- ``exclusive(fn)`` runs ``fn`` on the stepping thread with no sequence in flight: calls queued
  before it are admitted and finish first, calls queued after it wait until it returns (a weight
  sync, so that every turn is written by one version of the weights).

An exception from the engine's step fails the calls in flight and every later one with its
message: an engine that failed mid-step is not used again. ``close`` fails what is left and ends
the thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from nemo_orchestra.rollout.engines.base import Generation


class SteppedEngine(Protocol):
    def add_request(self, request_id: str, prompt: list[int], params: Any) -> None:
        """Queue one sequence; it decodes from the next ``step``."""
        ...

    def step(self) -> list[tuple[str, Generation]]:
        """One decode step of every queued sequence; the sequences it finished."""
        ...

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop queued sequences."""
        ...


@dataclass
class _Call:
    prompts: list[list[int]]
    params: Any
    on_admit: Callable[[], Any] | None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    results: list[Generation | None] = field(default_factory=list)
    left: int = 0
    tag: Any = None


@dataclass
class _Exclusive:
    fn: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class ContinuousBatcher:
    def __init__(self, engine: SteppedEngine, name: str = "engine-steps"):
        self.engine = engine
        self._cond = threading.Condition()
        self._queue: collections.deque[_Call | _Exclusive] = collections.deque()
        self._running: dict[str, tuple[_Call, int]] = {}  # request id -> (its call, its index there)
        self._ids = itertools.count()
        self._failure: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---- callers (any thread) ------------------------------------------------------------------
    def submit(
        self, prompts: list[list[int]], params: Any, on_admit: Callable[[], Any] | None = None
    ) -> concurrent.futures.Future:
        """One call's prompts, decoded beside those already running; the future gives
        ``(on_admit(), [Generation per prompt])``."""
        return self._put(_Call([list(p) for p in prompts], params, on_admit))

    def exclusive(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """``fn()`` on the stepping thread once the calls queued before it have finished; later calls
        wait for it. The future gives its result or raises its exception."""
        return self._put(_Exclusive(fn))

    def close(self, timeout_s: float = 60.0) -> None:
        """Fail the calls queued or in flight and end the stepping thread (after its current step)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def in_flight(self) -> int:
        """Sequences admitted and not finished."""
        return len(self._running)

    def _put(self, item):
        with self._cond:
            if self._closed or self._failure is not None:
                item.future.set_exception(RuntimeError(self._refusal()))
                return item.future
            self._queue.append(item)
            self._cond.notify()
        return item.future

    def _refusal(self) -> str:
        return f"the engine failed: {self._failure}" if self._failure else "the engine is closed"

    # ---- the stepping thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._queue or self._running):
                    self._cond.wait()
                if self._closed:
                    break
                admit = []
                while self._queue and isinstance(self._queue[0], _Call):
                    admit.append(self._queue.popleft())
                job = None
                if not admit and not self._running and self._queue:  # an exclusive call at the head
                    job = self._queue.popleft()
            for call in admit:
                self._admit(call)
            if job is not None:
                _settle(job.future, job.fn)
            elif self._running:
                try:
                    finished = self.engine.step()
                except BaseException as e:  # the engine's own failure: it is not stepped again
                    self._fail(f"{type(e).__name__}: {e}", e)
                    continue
                for request_id, gen in finished:
                    if request_id not in self._running:  # aborted meanwhile
                        continue
                    call, i = self._running.pop(request_id)
                    call.results[i] = gen
                    call.left -= 1
                    if call.left == 0:
                        call.future.set_result((call.tag, call.results))
        self._fail(None, None)

    def _admit(self, call: _Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        added = []
        try:
            call.tag = call.on_admit() if call.on_admit is not None else None
            call.results, call.left = [None] * len(call.prompts), len(call.prompts)
            if not call.prompts:
                call.future.set_result((call.tag, []))
                return
            for i, p in enumerate(call.prompts):
                request_id = f"c{next(self._ids)}"
                self.engine.add_request(request_id, p, call.params)
                self._running[request_id] = (call, i)
                added.append(request_id)
        except Exception as e:  # a prompt the engine refused (too long, ...): this call fails, not the engine
            for request_id in added:
                del self._running[request_id]
            try:
                if added:
                    self.engine.abort_requests(added)
            except BaseException as abort_error:
                self._fail(f"{type(abort_error).__name__}: {abort_error}", abort_error)
            call.future.set_exception(e)

    def _fail(self, why: str | None, error: BaseException | None) -> None:
        """Fail every call in flight and queued (``why`` set: the engine failed; None: closed)."""
        with self._cond:
            if why is not None:
                self._failure = why
            queued, self._queue = list(self._queue), collections.deque()
        calls = {id(c): c for c, _ in self._running.values()}
        self._running.clear()
        message = self._refusal()
        for item in list(calls.values()) + queued:
            if not item.future.done():
                exc = RuntimeError(message)
                if error is not None:
                    exc.__cause__ = error
                try:
                    item.future.set_exception(exc)
                except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                    pass


def _settle(future: concurrent.futures.Future, fn: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as e:  # handed to the caller
        future.set_exception(e)
