"""A per-run cgroup v2 group: an exact process list, an atomic kill, pids.max / memory.max where delegated."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time

from tools_env.sandbox.limits import SandboxLimits

logger = logging.getLogger(__name__)

_CGROUP_DIR = "nemo-sandbox"


def _cgroup_base() -> str | None:
    """A writable cgroup v2 directory for per-run groups: beside our own group, else at the root."""
    try:
        mounts = [line.split() for line in open("/proc/self/mountinfo")]
        roots = [f[4] for f in mounts if f[f.index("-") + 1] == "cgroup2"]
        own = next((line.strip()[3:] for line in open("/proc/self/cgroup") if line.startswith("0::")), None)
    except (OSError, ValueError):
        return None
    for root in roots:
        for parent in ([root + own] if own and own != "/" else []) + [root]:
            base = os.path.join(parent, _CGROUP_DIR)
            try:
                os.makedirs(base, exist_ok=True)
            except OSError:
                continue
            # moving a process needs write access to both groups' cgroup.procs (their common ancestor's, really)
            if all(os.access(os.path.join(d, "cgroup.procs"), os.W_OK) for d in (base, parent)):
                _enable_controllers(base)
                return base
    return None


def _enable_controllers(base: str) -> None:
    """Let run groups set pids.max / memory.max if our parent delegates those controllers to us."""
    try:
        available = open(os.path.join(base, "cgroup.controllers")).read().split()
        wanted = [c for c in ("pids", "memory") if c in available]
        if wanted:
            with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
                f.write(" ".join("+" + c for c in wanted))
    except OSError:
        pass


@functools.lru_cache(maxsize=None)
def _controllers(base: str) -> frozenset[str]:
    """The controllers the run groups below `base` get (read once: each open on cgroupfs costs)."""
    try:
        return frozenset(open(os.path.join(base, "cgroup.subtree_control")).read().split())
    except OSError:
        return frozenset()


class _Cgroup:
    def __init__(self, path: str, controllers: frozenset[str] = frozenset()):
        self.path, self.controllers = path, controllers

    @classmethod
    def create(cls, base: str | None, name: str, limits: SandboxLimits) -> _Cgroup | None:
        if base is None:
            return None
        group = cls(os.path.join(base, "run-" + name), _controllers(base))
        try:
            os.mkdir(group.path)
        except OSError as e:
            logger.warning("sandbox: cannot create cgroup %s: %s", group.path, e)
            return None
        if "pids" in group.controllers:
            group._write("pids.max", str(limits.max_processes))
        if "memory" in group.controllers:
            group._write("memory.max", str(limits.memory_mb << 20))
            group._write("memory.swap.max", "0")
        return group

    def _write(self, name: str, value: str) -> bool:
        try:
            fd = os.open(os.path.join(self.path, name), os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            os.write(fd, value.encode())
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def add(self, pid: int) -> bool:
        return self._write("cgroup.procs", str(pid))

    def kill(self) -> None:
        if not self._write("cgroup.kill", "1"):  # Linux < 5.14: freeze, kill each, thaw
            self._write("cgroup.freeze", "1")
            for pid in self.pids():  # frozen: none can exit, so none of these pids is recycled
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._write("cgroup.freeze", "0")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in open(os.path.join(self.path, "cgroup.procs")).read().split()]
        except OSError:
            return []

    def oom_killed(self) -> bool:
        if "memory" not in self.controllers:
            return False
        try:
            events = dict(line.split() for line in open(os.path.join(self.path, "memory.events")))
            return int(events.get("oom_kill", 0)) > 0
        except (OSError, ValueError):
            return False

    def try_remove(self) -> bool:
        """Remove the group if it is empty now; True when it is gone."""
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True

    def remove(self) -> bool:
        """Remove the group once its processes are gone (killed ones leave it a moment after
        SIGKILL); False when it is still busy after a second."""
        for delay in _REMOVE_DELAYS:
            if self.try_remove():
                return True
            time.sleep(delay)
        return self._busy()

    async def remove_async(self) -> bool:
        """`remove`, waiting in the event loop (no thread hop per run)."""
        for delay in _REMOVE_DELAYS:
            if self.try_remove():
                return True
            await asyncio.sleep(delay)
        return self._busy()

    def _busy(self) -> bool:
        if self.try_remove():
            return True
        logger.warning("sandbox: cgroup %s is still busy; left in place", self.path)
        return False


_REMOVE_DELAYS = [0.0005] * 20 + [0.005] * 200  # usually gone within a millisecond; at most ~1 s
