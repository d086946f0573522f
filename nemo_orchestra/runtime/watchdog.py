"""A watchdog that ends a run one of whose ranks has stopped (``run.stall_timeout_s``).

Every rank beats: a thread rewrites ``<run>/.heartbeats/rank-N`` every few seconds with a counter, the
step the rank is at, its pid and host. The same thread reads the other ranks' files and notes, on its own
clock, when each counter last moved (so the nodes' clocks need not agree, only share the run folder, as
their checkpoints do). A rank whose counter has not moved for ``stall_timeout_s`` is stopped — a process
frozen (SIGSTOP, a hung node, a swapped-out machine) beats no more, while a rank that merely waits in a
collective for it still does. Every other rank then says so in one line, naming the rank and its step,
and ends its process: the launcher (torchrun, srun) ends the rest, the last checkpoint stays as it was,
and the same command resumes from it. A rank that is alive but never joins a collective is the
collective timeout's (``parallel.collective_timeout_s``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

FOLDER = ".heartbeats"
EXIT_STALLED = 3  # the exit status of a rank that ended its run for a stopped one


class Watchdog:
    def __init__(
        self,
        run_dir: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        step: Callable[[], int] = lambda: 0,
        on_stall: Callable[[str], None] | None = None,
    ):
        """``step()``: the step this rank is at, written with each beat. ``on_stall(line)``: what to do
        when a rank stopped (default: log the line, end this process with ``EXIT_STALLED``)."""
        self.folder = os.path.join(run_dir, FOLDER)
        self.rank, self.world_size, self.timeout_s, self.step = rank, world_size, timeout_s, step
        self.interval_s = max(0.05, min(5.0, timeout_s / 10))
        self.on_stall = on_stall or _end_process
        self.beats = 0
        self._seen: dict[int, tuple[object, float]] = {}  # rank -> (its last counter, when it moved: our clock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> Watchdog:
        os.makedirs(self.folder, exist_ok=True)
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s * 2)

    def beat(self) -> None:
        self.beats += 1
        record = {"beat": self.beats, "step": self.step(), "pid": os.getpid(), "host": socket.gethostname()}
        path = os.path.join(self.folder, f"rank-{self.rank}")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)

    def stalled(self, now: float | None = None) -> tuple[int, dict] | None:
        """The first rank whose counter has not moved for ``timeout_s`` (and its last record), or None.
        A rank not yet heard from counts from the watchdog's first look."""
        now = time.monotonic() if now is None else now
        for r in range(self.world_size):
            if r == self.rank:
                continue
            record = _read(os.path.join(self.folder, f"rank-{r}"))
            counter = record.get("beat") if record else None
            last, since = self._seen.get(r, (object(), now))
            if counter != last:
                self._seen[r] = (counter, now)
            elif now - since >= self.timeout_s:
                return r, record or {}
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                found = self.stalled()
            except OSError as e:  # the run folder unreachable for a moment: the next beat tries again
                log.debug("watchdog: %s", e)
                continue
            if found is not None:
                r, record = found
                where = f"pid {record['pid']} on {record['host']}, " if "pid" in record else ""
                self.on_stall(
                    f"rank {r} ({where}at step {record.get('step', '?')}) has made no progress for "
                    f"{self.timeout_s:g} s (run.stall_timeout_s): ending the run; the same command resumes "
                    "from its last checkpoint"
                )
                return


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # not written yet, or caught between writes on a shared file system
        return None


def _end_process(line: str) -> None:
    log.error("%s", line)
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stderr.flush()
    os._exit(EXIT_STALLED)


def start_watchdog(run_dir: str, rank: int, world_size: int, timeout_s: float | None, step: Callable[[], int]):
    """A started watchdog for a run of several ranks; None for one rank or ``timeout_s`` null."""
    if world_size < 2 or not timeout_s:
        return None
    return Watchdog(run_dir, rank, world_size, timeout_s, step).start()
