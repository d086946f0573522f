"""One run, before it starts: its uid, its workdir, its process limit, the launcher's spec and argv."""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import random
import stat
import sys
import threading
from pathlib import Path

from tools_env.sandbox.allowlist import allowlist_conflict
from tools_env.sandbox.cleanup import _MARKER_VAR, _proc_status
from tools_env.sandbox.limits import SandboxLimits
from tools_env.sandbox.plan import _Plan, _strict

_UID_BASE, _UID_SPAN = 1_500_000_000, 1 << 24  # uid == gid of run n: _UID_BASE + (offset + n) % _UID_SPAN
_UIDS = itertools.count(random.randrange(_UID_SPAN))
_UID_LOCK = threading.Lock()


def _next_uid() -> int:
    with _UID_LOCK:
        return _UID_BASE + next(_UIDS) % _UID_SPAN


def _check_workdir(workdir: str, plan: _Plan) -> tuple[str, str | None]:
    """The workdir's real path, and the highest directory above it that the run's uid cannot
    search (the mount namespace then puts a tmpfs there holding just the workdir), if any."""
    wd = os.path.realpath(workdir)
    if not os.path.isdir(wd):
        raise ValueError(f"sandbox workdir {workdir!r} is not a directory")
    if plan.layers["allowlist"]:
        conflict = allowlist_conflict(wd, plan.allow)
        if conflict:
            raise ValueError(f"sandbox workdir {workdir!r}: {conflict}")
    if not plan.layers["uid_drop"]:
        return wd, None
    closed = next((d for d in _ancestors(wd) if not os.stat(d).st_mode & stat.S_IXOTH), None)
    if closed is not None and not plan.layers["mountns"]:
        raise ValueError(
            f"sandbox workdir {workdir!r}: {closed} is not searchable by others, "
            "so the sandbox uid cannot reach the workdir"
        )
    if closed is not None and os.path.realpath(plan.python).startswith(closed + "/"):
        raise ValueError(f"sandbox workdir {workdir!r} and the sandbox python share the private directory {closed}")
    return wd, closed


def _ancestors(path: str) -> list[str]:
    """ "/a/b/c" -> ["/", "/a", "/a/b"]"""
    out = []
    while path != "/":
        path = os.path.dirname(path)
        out.append(path)
    return out[::-1]


def _prepare(wd: str, uid: int | None, plan: _Plan, limits: SandboxLimits) -> int:
    """Hand the workdir to the run's uid and return its RLIMIT_NPROC (runs in a worker thread)."""
    _take_ownership(wd, uid)
    return _nproc_limit(plan, uid, limits.max_processes)


def _prepare_is_quick(wd: str, uid: int | None, plan: _Plan, most: int = 64) -> bool:
    """Is `_prepare` quick enough for the event loop: a workdir without subdirectories and with at
    most `most` entries, and a process limit that needs no /proc scan?"""
    if uid is None and not plan.layers["userns"]:
        return False
    try:
        return os.stat(wd).st_nlink <= 2 and len(os.listdir(wd)) <= most
    except OSError:
        return False


def _take_ownership(wd: str, uid: int | None) -> None:
    """chown the workdir tree to `uid`: entries of earlier runs, and the caller's own entries except
    regular files with several links (a hard link to a file elsewhere must not change owner).
    fwalk works on directory fds and never follows symlinks."""
    if uid is None:
        return
    os.chown(wd, uid, uid)
    os.chmod(wd, 0o700)
    me = os.geteuid()
    for _, dirs, files, dfd in os.fwalk(wd):
        for name in dirs + files:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                ours = _UID_BASE <= st.st_uid < _UID_BASE + _UID_SPAN
                if ours or (st.st_uid == me and not (stat.S_ISREG(st.st_mode) and st.st_nlink > 1)):
                    os.chown(name, uid, uid, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                pass


def _nproc_limit(plan: _Plan, uid: int | None, max_processes: int) -> int:
    if uid is not None:
        return max_processes  # counted for this uid only
    if plan.layers["userns"]:  # counted per user namespace, which also holds the launcher and pid 1
        return max_processes + (2 if plan.layers["pidns"] else 0)
    me, tasks = os.getuid(), 0  # shared with everything this user runs: allow what exists plus the run
    for status in _proc_status():
        if status.get("Uid", "").split()[:1] == [str(me)]:
            tasks += int(status.get("Threads", "1"))
    return tasks + max_processes


# The launcher, the zygote and the bootstrap are programs, kept as files beside this one and handed
# over as text (`-c` and argv): neither they nor the sandbox uid have to read a file in the
# repository. The launcher and the zygote share the layers (layers.py in front of their text).
def _program(*names: str) -> str:
    return "\n".join((Path(__file__).parent / name).read_text(encoding="utf-8") for name in names)


_LAUNCHER = _program("layers.py", "launcher.py")
_ZYGOTE = _program("layers.py", "zygote.py")
_BOOTSTRAP = _program("bootstrap.py")


@functools.lru_cache(maxsize=None)
def _realpath(path: str) -> str:
    return os.path.realpath(path)


def _launch_spec(
    plan: _Plan,
    wd: str,
    uid: int | None,
    limits: SandboxLimits,
    nproc: int,
    closed_parent: str | None = None,
    probe: bool = False,
) -> dict:
    ly = plan.layers
    cpu = math.ceil(limits.cpu_time_s)
    mb = 1 << 20
    flags = [
        name
        for name, on in (("net", not limits.network), ("strict", _strict(plan, limits.network)), ("probe", probe))
        if on
    ]
    return {
        "workdir": wd,
        "closed_parent": closed_parent,
        "python": plan.python,
        "probe": probe,
        "mask_run": not any(p.startswith("/run/") for p in (wd + "/", _realpath(plan.python))),  # host sockets
        "bootstrap": _BOOTSTRAP,
        "flags": ",".join(flags),
        "uid": uid,
        "userns": ly["userns"],
        "netns": ly["netns"] and not limits.network,
        "pidns": ly["pidns"],
        "mountns": ly["mountns"],
        "allow": plan.allow if ly["allowlist"] else None,
        "proc": ly["proc"],
        "nnp": ly["nnp"],
        "shm_mb": min(64, limits.memory_mb),
        "rlimits": {
            "RLIMIT_CPU": [cpu, cpu + 1],
            "RLIMIT_AS": [limits.memory_mb * mb] * 2,
            "RLIMIT_FSIZE": [limits.file_size_mb * mb] * 2,
            "RLIMIT_NOFILE": [256, 256],
            "RLIMIT_CORE": [0, 0],
            "RLIMIT_NPROC": [nproc, nproc],
        },
    }


def _launcher_argv(spec: dict) -> list[str]:
    return [sys.executable, "-I", "-S", "-B", "-c", _LAUNCHER, json.dumps(spec)]


def _sandbox_env(wd: str, marker: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": wd,
        "TMPDIR": wd,
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MALLOC_ARENA_MAX": "2",  # glibc reserves 64 MB of address space per thread arena
        _MARKER_VAR: marker,
    }
