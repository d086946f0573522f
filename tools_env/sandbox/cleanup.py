"""Killing what is left of a run: its process group, and every process found by its uid or marker."""

from __future__ import annotations

import logging
import os
import signal
import time

logger = logging.getLogger(__name__)

_MARKER_VAR = "NEMO_SANDBOX_RUN"


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _proc_status():
    """Parsed /proc/<pid>/status of every process, with "Pid" set."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    yield dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
            except OSError:
                continue


def _strays(uid: int | None, marker: str) -> list[int]:
    """Live processes of the run: its uid when it has one, else its marker variable in the environment."""
    return [int(st["Pid"]) for st in _proc_status() if _is_ours(st, uid, marker)]


def _is_ours(st: dict[str, str], uid: int | None, marker: str) -> bool:
    if st.get("State", "").startswith(("Z", "X")):
        return False  # already dead
    ruid = st.get("Uid", "").split()[:1]
    if uid is not None:
        return ruid == [str(uid)]
    if ruid != [str(os.getuid())] or st.get("Pid") == str(os.getpid()):
        return False
    try:
        with open(f"/proc/{st['Pid']}/environ", "rb") as f:
            return f"{_MARKER_VAR}={marker}\0".encode() in f.read(1 << 20)
    except OSError:
        return False


def _kill_strays(uid: int | None, marker: str, timeout: float = 5.0) -> bool:
    """SIGKILL whatever of the run outlived its process group and cgroup until none is left."""
    deadline = time.monotonic() + timeout
    while pids := _strays(uid, marker):
        if time.monotonic() > deadline:
            logger.error("sandbox: processes %s of a finished run survive SIGKILL", pids)
            return False
        for pid in pids:
            _kill_pid(pid, uid, marker)
        time.sleep(0.005)
    return True


def _kill_pid(pid: int, uid: int | None, marker: str) -> None:
    """SIGKILL `pid` if it is still the run's, checked through a pidfd so that a recycled pid is
    never hit (plain kill(2) on kernels without pidfds, Linux < 5.3)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:
        fd = None
    try:
        with open(f"/proc/{pid}/status") as f:
            st = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        if _is_ours(st, uid, marker):
            if fd is None:
                os.kill(pid, signal.SIGKILL)
            else:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (OSError, ValueError):
        pass
    finally:
        if fd is not None:
            os.close(fd)
