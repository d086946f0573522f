"""Run untrusted, model-written Python in a throw-away, resource-limited process.

    result = await run_python("print(1 + 1)", workdir, SandboxLimits(wall_time_s=5))
    assert result.stdout == "2\\n" and result.exit_code == 0

A run, step by step:
  1. A *launcher* (`python -I -S -c _LAUNCHER`, the service's own interpreter) starts in a new
     session with a minimal environment (no inherited secrets) and is put in a per-run cgroup;
     then the code is written to its stdin.
  2. The launcher, still privileged, enters the isolation layers this host allows (below); in the
     pid namespace it forks pid 1, which forks the process that sets the rlimits, drops to a
     fresh uid and execs the sandbox interpreter `python -I -B -u -c _BOOTSTRAP` with stdin on
     /dev/null. The launcher waits outside and exits the way the code did.
  3. The bootstrap installs an audit hook, then runs the code as `__main__` with the workdir as
     cwd, HOME, TMPDIR and `sys.path[0]`.
  4. stdout+stderr stream into one buffer capped at `max_output_bytes`. The run ends when the
     code exits, the wall clock runs out or the cap is passed; then every process of the run is
     killed: `cgroup.kill`, the process group, and a /proc scan for the run's uid (root) or the
     run's marker variable (not root), repeated until none is left.

Layers, by their `sandbox_capabilities()` names, with what each stops and what it does not:
  uid_drop          root only. A fresh uid/gid per run, no supplementary groups, workdir chowned
                    to it. Stops writes to anything not world-writable, signals/ptrace to other
                    processes, and makes RLIMIT_NPROC count exactly this run (root ignores it).
                    Does not stop reads of world-readable files.
  user_namespace    not root, where unprivileged user namespaces are allowed: what makes the two
                    namespaces below possible without root; RLIMIT_NPROC then counts per run.
  network_namespace a new, empty network namespace (loopback down): no TCP/UDP anywhere, host
                    loopback included. Unix sockets on the filesystem are not covered by it.
  pid_namespace     the code runs as pid 2 under a small init (pid 1, the launcher) that reaps
                    orphans and exits when the code's process does, and the kernel then kills
                    everything left in the namespace, setsid or not. Other processes cannot be
                    seen, signalled or ptraced, even by the same uid (which matters when not root).
  mount_namespace   a private mount tree in which every mount is re-mounted read-only and nosuid,
                    except the workdir (nosuid, nodev, noexec); a private tmpfs on /dev/shm (at
                    most 64 MB, for POSIX semaphores) and an empty read-only one over /run (host
                    unix sockets). Stops writes to /tmp,
                    /dev/shm and any other world-writable place, and running binaries or loading
                    .so files written by the code. Checked after set-up: a writable mount left is
                    an error.
  private_proc      a fresh /proc for the pid namespace (hidepid=2 where allowed): only the run's
                    processes, so no command line or environment of the service or other runs.
  no_new_privs      PR_SET_NO_NEW_PRIVS: setuid binaries (su, mount, ...) gain nothing.
  cgroup            a per-run cgroup v2 group (pure v2, or the hybrid layout's "unified" mount): an
                    exact process list and an atomic kill; it also sets pids.max / memory.max
                    where those controllers are delegated to us.
  rlimits           always: CPU seconds per process (SIGXCPU, SIGKILL a second later), address
                    space (virtual, not resident: many threads or big reservations hit it early),
                    file size, open files, no core files, processes/threads.
  audit_hook        always (Python >= 3.8), installed before the code runs and not removable from
                    Python: refuses writes (open for writing, remove, rename, mkdir, link, chmod,
                    sqlite3.connect, ...) outside the workdir, socket connect/bind/sendto/sendmsg
                    and name lookups (when network=False; unix sockets inside the workdir are
                    allowed), imports of ctypes/cffi and every ctypes event, and swapping the
                    __code__/__defaults__ of the hook's own functions. It is a tripwire for
                    Python-level calls, not a boundary: native code, C extensions (os.mkfifo,
                    dbm, ...) and any child program are not seen by it.
  audit_strict      when a kernel layer for network, filesystem or other processes is missing,
                    the hook also refuses starting programs (subprocess, os.exec*, posix_spawn,
                    os.system), gc.get_objects/get_referrers/get_referents and opening
                    /proc/<pid>/ of other processes, so the code cannot simply run another
                    interpreter without the hook. A deliberate attacker still gets past it (e.g.
                    `_posixsubprocess.fork_exec` raises no audit event): on such a host the
                    sandbox stops accidents and naive code only.

Not root (CI, laptops): no uid drop. With unprivileged user namespaces the network, pid and
mount namespaces are used as above, and they carry the weight the uid carries for root: the code
still runs as the service's own uid, but it cannot see it, signal it or write outside the
workdir. Without user namespaces only the rlimits and the strict audit hook remain: RLIMIT_NPROC
is the user's current task count plus `max_processes` (shared with everything the user runs),
signals to the user's other processes are not stopped, and cleanup finds escaped processes by
the marker variable, so one that both calls setsid and re-execs with a clean environment
survives the run. Nothing here raises because a layer is missing; `sandbox_capabilities()` says
what is active.

Other things to know:
  * The sandbox interpreter must be runnable by the dropped uid: NEMO_SANDBOX_PYTHON if set, else
    this interpreter when every directory above it is world-searchable, else /usr/local/bin or
    /usr/bin python3 (on this image the venv lives under /root, so code gets Debian's python3 and
    its packages). scipy imports ctypes and therefore fails to import in the sandbox.
  * When root, each run takes ownership of the workdir tree (chown to its uid), so two runs must
    not share a workdir at the same time. A workdir below a directory others cannot search
    (mkdtemp's 0700) is reached through the mount namespace; without one that is a ValueError.
  * No seccomp filter: the kernel's syscall surface is the host's (ctypes is refused and the
    workdir is noexec, so new native code cannot be loaded, but installed binaries can run).
  * In the pid namespace the code's own pid is 2; its parent is the sandbox's init.
  * NEMO_SANDBOX_DISABLE=uid,userns,netns,pidns,mountns,cgroup turns layers off (tests, debugging).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_UID_BASE, _UID_SPAN = 1_500_000_000, 1 << 24  # uid == gid of run n: _UID_BASE + (offset + n) % _UID_SPAN
_MARKER_VAR = "NEMO_SANDBOX_RUN"
_SETUP_FAILED = 125  # launcher exit status when a promised layer could not be entered
_CGROUP_DIR = "nemo-sandbox"


@dataclass(frozen=True)
class SandboxLimits:
    cpu_time_s: float = 10.0  # RLIMIT_CPU, rounded up to whole seconds
    wall_time_s: float = 15.0  # killed after this
    memory_mb: int = 512  # RLIMIT_AS (and memory.max where a memory cgroup is available)
    max_processes: int = 16  # processes + threads of the run, its main process included
    max_output_bytes: int = 65536  # stdout+stderr kept; beyond it the run is killed, truncated=True
    file_size_mb: int = 16  # RLIMIT_FSIZE
    network: bool = False  # no network unless True

    def __post_init__(self):
        for name in ("cpu_time_s", "wall_time_s", "memory_mb", "max_processes", "max_output_bytes", "file_size_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when the sandbox killed the run; negative: killed by that signal
    timed_out: bool  # killed_reason is "wall_time" or "cpu_time"
    killed_reason: str | None  # wall_time, cpu_time, memory, output_limit, signal, sandbox_error, None
    wall_s: float
    truncated: bool


# --------------------------------------------------------------------------- public API


async def run_python(code: str, workdir: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in the sandbox with `workdir` as its only writable place; never raises for what the code does."""
    plan = _PLANS.get(_disabled()) or await asyncio.to_thread(_get_plan)
    wd, closed = _check_workdir(workdir, plan)
    uid = _next_uid() if plan.layers["uid_drop"] else None
    marker = uuid.uuid4().hex
    nproc = await asyncio.to_thread(_prepare, wd, uid, plan, limits)
    spec = _launch_spec(plan, wd, uid, limits, nproc, closed)
    cgroup = _Cgroup.create(plan.cgroup_base, marker, limits)
    loop = asyncio.get_running_loop()
    status_r, spec["status_fd"] = os.pipe()
    t0 = time.monotonic()
    try:
        transport, proto = await loop.subprocess_exec(
            lambda: _Capture(loop, limits.max_output_bytes),
            *_launcher_argv(spec), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(spec["status_fd"],), start_new_session=True, env=_sandbox_env(wd, marker), cwd=wd)
    except BaseException:
        os.close(status_r)
        if cgroup:
            cgroup.remove()
        raise
    finally:
        os.close(spec["status_fd"])
    reason = None
    try:
        if cgroup and not cgroup.add(transport.get_pid()):  # before the code is sent: the launcher waits for it
            cgroup.remove()
            cgroup = None
        stdin = transport.get_pipe_transport(0)
        stdin.write(code.encode("utf-8", "surrogateescape"))
        stdin.close()
        reason = await proto.wait(limits.wall_time_s - (time.monotonic() - t0))
    finally:
        wall_s = time.monotonic() - t0
        # shielded: a cancelled caller still gets every process of the run killed
        status, oom = await asyncio.shield(asyncio.ensure_future(
            _finish(transport, proto, status_r, cgroup, uid, marker)))
    return _result(proto, transport.get_returncode(), reason, status, oom, wall_s, limits)


async def _finish(transport, proto, status_r: int, cgroup: _Cgroup | None, uid: int | None,
                  marker: str) -> tuple[list[str], bool]:
    """Kill every process of the run, collect the rest of its output and its status lines."""
    if cgroup:
        cgroup.kill()
    _killpg(transport.get_pid())
    await asyncio.to_thread(_kill_strays, uid, marker)
    await proto.drained(1.0)
    transport.close()
    status = _read_status(status_r)
    oom = bool(cgroup and cgroup.oom_killed())
    if cgroup:
        await asyncio.to_thread(cgroup.remove)
    return status, oom


def run_python_sync(code: str, workdir: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """`run_python` for callers without an event loop (not from inside a running loop)."""
    return asyncio.run(run_python(code, workdir, limits))


def sandbox_capabilities() -> dict[str, bool]:
    """Which isolation layers a run gets on this host (see the module docstring); probed once."""
    plan = _get_plan()
    ly = plan.layers
    return {
        "root": plan.root,
        "uid_drop": ly["uid_drop"],
        "user_namespace": ly["userns"],
        "network_namespace": ly["netns"],
        "mount_namespace": ly["mountns"],
        "pid_namespace": ly["pidns"],
        "private_proc": ly["proc"],
        "no_new_privs": ly["nnp"],
        "cgroup": plan.cgroup_base is not None,
        "rlimits": True,
        "nproc_per_run": ly["uid_drop"] or ly["userns"],
        "audit_hook": plan.python_ok,
        "audit_strict": _strict(plan, network=False),
        "python_ok": plan.python_ok,
    }


# --------------------------------------------------------------------------- host plan (probed once)


@dataclass(frozen=True)
class _Plan:
    root: bool
    python: str  # the sandbox interpreter
    layers: dict  # uid_drop, userns, netns, pidns, mountns, proc, nnp -> entered by the probe
    python_ok: bool  # the probe's bootstrap ran under all the layers
    cgroup_base: str | None


_PLANS: dict[str, _Plan] = {}
_PLAN_LOCK = threading.Lock()
_UIDS = itertools.count(random.randrange(_UID_SPAN))
_UID_LOCK = threading.Lock()


def _disabled() -> str:
    return os.environ.get("NEMO_SANDBOX_DISABLE", "")


def _get_plan() -> _Plan:
    key = _disabled()
    with _PLAN_LOCK:
        if key not in _PLANS:
            _PLANS[key] = _probe(set(filter(None, key.split(","))))
            missing = [k for k, v in _key_layers(_PLANS[key]).items() if not v]
            if missing:
                logger.warning("code sandbox runs without: %s (see tools_env/sandbox.py)", ", ".join(missing))
        return _PLANS[key]


def _key_layers(plan: _Plan) -> dict[str, bool]:
    return {"uid_drop or user_namespace": plan.layers["uid_drop"] or plan.layers["userns"],
            "network_namespace": plan.layers["netns"], "mount_namespace": plan.layers["mountns"],
            "pid_namespace": plan.layers["pidns"], "private_proc": plan.layers["proc"],
            "cgroup": plan.cgroup_base is not None, "python": plan.python_ok}


def _probe(disabled: set[str]) -> _Plan:
    """Run the launcher once in probe mode: it tries every layer, reports which it entered, then
    execs the bootstrap, which reports that the interpreter and the audit hook work."""
    root = os.geteuid() == 0
    want = {"uid_drop": root and "uid" not in disabled, "userns": not root and "userns" not in disabled,
            "netns": "netns" not in disabled, "pidns": "pidns" not in disabled,
            "mountns": "mountns" not in disabled, "nnp": True}
    want["proc"] = want["mountns"]
    python = _sandbox_python(want["uid_drop"])
    plan = _Plan(root, python, want, False, None)
    wd = tempfile.mkdtemp(prefix="nemo-sandbox-probe-", dir="/tmp" if os.path.isdir("/tmp") else None)
    uid = _next_uid() if want["uid_drop"] else None
    marker = uuid.uuid4().hex
    try:
        spec = _launch_spec(plan, wd, uid, SandboxLimits(), _nproc_limit(plan, uid, 16), None, probe=True)
        _take_ownership(wd, uid)
        r, w = os.pipe()
        spec["status_fd"] = w
        try:
            subprocess.run(_launcher_argv(spec), input=b"", capture_output=True, pass_fds=(w,), timeout=60,
                           start_new_session=True, env=_sandbox_env(wd, marker), cwd=wd)
        except subprocess.TimeoutExpired:
            pass
        finally:
            os.close(w)
        status = _read_status(r)
    finally:
        _kill_strays(uid, marker)
        shutil.rmtree(wd, ignore_errors=True)
    entered = next((json.loads(line[7:]) for line in status if line.startswith("layers ")), {})
    layers = {k: bool(want[k] and entered.get(k)) for k in want}
    cgroup = None if "cgroup" in disabled else _cgroup_base()
    return _Plan(root, python, layers, "probe-ok" in status, cgroup)


def _sandbox_python(drop_uid: bool) -> str:
    if os.environ.get("NEMO_SANDBOX_PYTHON"):
        return os.environ["NEMO_SANDBOX_PYTHON"]
    candidates = [sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"]
    for exe in candidates:
        if exe and os.path.exists(exe) and (not drop_uid or _world_executable(exe)):
            return exe
    return sys.executable  # the probe will report python_ok=False


def _world_executable(path: str) -> bool:
    """Can a uid that is neither owner nor group run `path`?"""
    path = os.path.realpath(path)
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in [*_ancestors(path), path])


def _strict(plan: _Plan, network: bool) -> bool:
    """The audit hook is the only barrier for network, filesystem or other processes, so it refuses more."""
    ly = plan.layers
    return not (ly["mountns"] and (network or ly["netns"]) and (ly["uid_drop"] or ly["pidns"] and ly["proc"]))


def _next_uid() -> int:
    with _UID_LOCK:
        return _UID_BASE + next(_UIDS) % _UID_SPAN


# --------------------------------------------------------------------------- one run: preparation


def _check_workdir(workdir: str, plan: _Plan) -> tuple[str, str | None]:
    """The workdir's real path, and the highest directory above it that the run's uid cannot
    search (the mount namespace then puts a tmpfs there holding just the workdir), if any."""
    wd = os.path.realpath(workdir)
    if not os.path.isdir(wd):
        raise ValueError(f"sandbox workdir {workdir!r} is not a directory")
    if not plan.layers["uid_drop"]:
        return wd, None
    closed = next((d for d in _ancestors(wd) if not os.stat(d).st_mode & stat.S_IXOTH), None)
    if closed is not None and not plan.layers["mountns"]:
        raise ValueError(f"sandbox workdir {workdir!r}: {closed} is not searchable by others, "
                         "so the sandbox uid cannot reach the workdir")
    if closed is not None and os.path.realpath(plan.python).startswith(closed + "/"):
        raise ValueError(f"sandbox workdir {workdir!r} and the sandbox python share the private directory {closed}")
    return wd, closed


def _ancestors(path: str) -> list[str]:
    """"/a/b/c" -> ["/", "/a", "/a/b"]"""
    out = []
    while path != "/":
        path = os.path.dirname(path)
        out.append(path)
    return out[::-1]


def _prepare(wd: str, uid: int | None, plan: _Plan, limits: SandboxLimits) -> int:
    """Hand the workdir to the run's uid and return its RLIMIT_NPROC (runs in a worker thread)."""
    _take_ownership(wd, uid)
    return _nproc_limit(plan, uid, limits.max_processes)


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


def _launch_spec(plan: _Plan, wd: str, uid: int | None, limits: SandboxLimits, nproc: int,
                 closed_parent: str | None = None, probe: bool = False) -> dict:
    ly = plan.layers
    cpu = math.ceil(limits.cpu_time_s)
    mb = 1 << 20
    flags = [name for name, on in (("net", not limits.network), ("strict", _strict(plan, limits.network)),
                                   ("probe", probe)) if on]
    return {
        "workdir": wd, "closed_parent": closed_parent, "python": plan.python, "probe": probe,
        "bootstrap": _BOOTSTRAP, "flags": ",".join(flags),
        "uid": uid, "userns": ly["userns"], "netns": ly["netns"] and not limits.network, "pidns": ly["pidns"],
        "mountns": ly["mountns"], "proc": ly["proc"], "nnp": ly["nnp"], "shm_mb": min(64, limits.memory_mb),
        "rlimits": {"RLIMIT_CPU": [cpu, cpu + 1], "RLIMIT_AS": [limits.memory_mb * mb] * 2,
                    "RLIMIT_FSIZE": [limits.file_size_mb * mb] * 2, "RLIMIT_NOFILE": [256, 256],
                    "RLIMIT_CORE": [0, 0], "RLIMIT_NPROC": [nproc, nproc]},
    }


def _launcher_argv(spec: dict) -> list[str]:
    return [sys.executable, "-I", "-S", "-B", "-c", _LAUNCHER, json.dumps(spec)]


def _sandbox_env(wd: str, marker: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": wd, "TMPDIR": wd, "USER": "sandbox",
            "LOGNAME": "sandbox", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "MPLBACKEND": "Agg",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "MALLOC_ARENA_MAX": "2",  # glibc reserves 64 MB of address space per thread arena
            _MARKER_VAR: marker}


# --------------------------------------------------------------------------- one run: output and result


class _Capture(asyncio.SubprocessProtocol):
    """Keeps the first `cap` bytes of stdout+stderr and drops the rest as it arrives."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cap: int):
        self.cap, self.out, self.truncated = cap, {1: bytearray(), 2: bytearray()}, False
        self.exited, self.overflow, self.closed = loop.create_future(), loop.create_future(), loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        room = self.cap - len(self.out[1]) - len(self.out[2])
        self.out[fd] += data[:max(room, 0)]
        if len(data) > room:
            self.truncated = True
            _done(self.overflow)

    def process_exited(self) -> None:
        _done(self.exited)

    def connection_lost(self, exc: Exception | None) -> None:
        _done(self.closed)

    async def wait(self, timeout: float) -> str | None:
        """None when the code exited by itself, else why the sandbox has to kill it."""
        await asyncio.wait((self.exited, self.overflow), timeout=max(timeout, 0), return_when=asyncio.FIRST_COMPLETED)
        if self.exited.done():
            return None
        return "output_limit" if self.overflow.done() else "wall_time"

    async def drained(self, timeout: float) -> None:
        await asyncio.wait((self.closed,), timeout=timeout)


def _done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _read_status(fd: int) -> list[str]:
    """Lines the launcher and bootstrap wrote on the status pipe (every writer is dead by now)."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while len(data) < 1 << 16 and (chunk := os.read(fd, 1 << 16)):
            data += chunk
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").splitlines()


def _result(proto: _Capture, rc: int | None, reason: str | None, status: list[str], oom: bool,
            wall_s: float, limits: SandboxLimits) -> SandboxResult:
    stderr = proto.out[2].decode("utf-8", "replace")
    errors = [line[6:] for line in status if line.startswith("error ")]
    if reason is None:
        if errors or rc == _SETUP_FAILED and "ready" not in status:
            reason = "sandbox_error"
            stderr += "sandbox set-up failed: " + ("; ".join(errors) or "launcher exited early") + "\n"
        elif oom or "memory" in status:
            reason = "memory"
        elif rc == -signal.SIGXCPU or rc == -signal.SIGKILL and wall_s >= math.ceil(limits.cpu_time_s) + 1:
            reason = "cpu_time"  # soft limit: SIGXCPU; hard limit (SIGXCPU ignored): SIGKILL
        elif rc is not None and rc < 0:
            reason = "signal"
    killed_by_us = reason in ("wall_time", "output_limit")
    return SandboxResult(
        stdout=proto.out[1].decode("utf-8", "replace"), stderr=stderr,
        exit_code=None if killed_by_us else rc, timed_out=reason in ("wall_time", "cpu_time"),
        killed_reason=reason, wall_s=round(wall_s, 3), truncated=proto.truncated)


# --------------------------------------------------------------------------- one run: cleanup


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


class _Cgroup:
    def __init__(self, path: str):
        self.path = path

    @classmethod
    def create(cls, base: str | None, name: str, limits: SandboxLimits) -> _Cgroup | None:
        if base is None:
            return None
        group = cls(os.path.join(base, "run-" + name))
        try:
            os.mkdir(group.path)
        except OSError as e:
            logger.warning("sandbox: cannot create cgroup %s: %s", group.path, e)
            return None
        group._write("pids.max", str(limits.max_processes))
        group._write("memory.max", str(limits.memory_mb << 20))
        group._write("memory.swap.max", "0")
        return group

    def _write(self, name: str, value: str) -> bool:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(value)
            return True
        except OSError:
            return False

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
        try:
            events = dict(line.split() for line in open(os.path.join(self.path, "memory.events")))
            return int(events.get("oom_kill", 0)) > 0
        except (OSError, ValueError):
            return False

    def remove(self) -> None:
        for _ in range(200):  # killed processes leave the group a moment after SIGKILL
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.005)
        logger.warning("sandbox: cgroup %s is still busy; left in place", self.path)


# --------------------------------------------------------------------------- code that runs in the child

# The launcher: run by the service's interpreter, privileged, single-threaded, stdlib only.
# argv[1] is the spec from _launch_spec; stdin carries the code; the status fd gets
# "layers {json}" (probe) or "error <what>" lines.
_LAUNCHER = r'''
import ctypes, json, os, re, resource, signal, sys

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.umask(0o022)
spec = json.loads(sys.argv[1])
status, wd, probe = spec["status_fd"], spec["workdir"], spec["probe"]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
NEWNS, NEWUSER, NEWPID, NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
KEEP = NOSUID | NODEV | NOEXEC | 1024 | 2048 | (1 << 21)  # + noatime, nodiratime, relatime
STRICTATIME = 1 << 24
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
PSEUDO = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs",
          "pstore", "bpf", "fusectl", "configfs", "binfmt_misc", "autofs", "efivarfs", "rpc_pipefs", "nsfs"}

def say(line):
    os.write(status, (line + "\n").encode())

def check(ret):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

def mount(src, dst, fstype, flags, data=None):
    b = lambda s: None if s is None else s.encode()
    check(libc.mount(b(src), b(dst), b(fstype), flags, b(data)))

def remount(path, add, drop=0):
    keep = os.statvfs(path).f_flag & KEEP & ~drop
    try:
        mount(None, path, None, REMOUNT | BIND | add | keep)
    except PermissionError:  # inside a user namespace an inherited strictatime mount must stay so
        mount(None, path, None, REMOUNT | BIND | add | keep | STRICTATIME)

def mountpoints():
    for line in open("/proc/self/mountinfo"):
        f = line.split()
        yield re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), f[4]), f[f.index("-") + 1]

def end_like(st):
    """Exit the way a child with wait status `st` did."""
    if os.WIFSIGNALED(st):
        sig = os.WTERMSIG(st)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 1)

def enter_userns():
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(NEWUSER))
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)

def enter_pidns():
    """Fork the namespace's pid 1. This process stays outside, waits, and ends as the code did."""
    global to_outside
    check(libc.unshare(NEWPID))
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        st = os.waitpid(pid, 0)[1]
        got = os.read(r, 32)
        end_like(int(got) if got else st)
    os.close(r)
    to_outside = w
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))

def become_init():
    """As pid 1: fork the process that runs the code, reap orphans until it ends, report its
    status outside and exit, which kills whatever is left in the namespace."""
    pid = os.fork()
    if pid == 0:
        os.close(to_outside)
        return
    os.close(0), os.close(1), os.close(2)
    while True:
        got, st = os.waitpid(-1, 0)
        if got == pid:
            os.write(to_outside, str(st).encode())
            os._exit(0)

def enter_mountns():
    check(libc.unshare(NEWNS))
    mount(None, "/", None, REC | PRIVATE)
    closed = spec["closed_parent"]
    if closed:  # the uid cannot search `closed`: a tmpfs over it holds only the workdir, same path
        fd = os.open(wd, os.O_PATH | os.O_DIRECTORY)
        mount("tmpfs", closed, "tmpfs", NOSUID | NODEV | NOEXEC, "size=16k,mode=755")
        os.makedirs(wd)
        mount(f"/proc/self/fd/{fd}", wd, None, BIND | REC)
        os.close(fd)
    else:
        mount(wd, wd, None, BIND | REC)
    private = {wd}
    if os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", NOSUID | NODEV | NOEXEC, f"size={spec['shm_mb']}m,mode=1777")
        private.add("/dev/shm")
    python = os.path.realpath(spec["python"])
    if os.path.isdir("/run") and not any(p.startswith("/run/") for p in (wd + "/", python)):
        mount("tmpfs", "/run", "tmpfs", RDONLY | NOSUID | NODEV | NOEXEC, "size=16k,mode=755")
    for path, fstype in list(mountpoints()):
        if path not in private and not path.startswith(wd + "/"):
            try:
                remount(path, RDONLY | NOSUID)
            except OSError:
                pass  # hidden under another mount, or pseudo: checked below
    remount(wd, NOSUID | NODEV | NOEXEC, drop=RDONLY)
    for path, fstype in mountpoints():
        if fstype not in PSEUDO and path not in private and not path.startswith(wd + "/"):
            try:
                writable = not os.statvfs(path).f_flag & RDONLY
            except OSError:
                continue  # hidden under another mount
            if writable:
                raise OSError(f"{path} is still writable")

def mount_proc():
    """A /proc of our own: the pid namespace's processes only (hidepid=2: only the uid's own)."""
    flags = NOSUID | NODEV | NOEXEC
    try:
        mount("proc", "/proc", "proc", flags, "hidepid=2")
    except OSError:
        mount("proc", "/proc", "proc", flags)

def drop_uid():
    uid = spec["uid"]
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)

def set_rlimits():
    for name, (soft, hard) in spec["rlimits"].items():
        which = getattr(resource, name)
        cur = resource.getrlimit(which)[1]
        hard = hard if cur == resource.RLIM_INFINITY else min(hard, cur)
        resource.setrlimit(which, (min(soft, hard), hard))

def layer(name, fn, wanted):
    if not wanted:
        return
    try:
        fn()
        done[name] = True
    except Exception as e:
        done[name] = False
        if not probe:
            say(f"error {name}: {e}")
            os._exit(125)

done = {}
code = b"".join(iter(lambda: os.read(0, 1 << 20), b""))
null = os.open("/dev/null", os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
code_fd = os.memfd_create("sandbox-code")
os.write(code_fd, code)
os.lseek(code_fd, 0, os.SEEK_SET)
os.set_inheritable(code_fd, True)
layer("userns", enter_userns, spec["userns"])
layer("netns", lambda: check(libc.unshare(NEWNET)), spec["netns"])
layer("pidns", enter_pidns, spec["pidns"])
layer("mountns", enter_mountns, spec["mountns"])
layer("proc", mount_proc, spec["proc"])
if done.get("pidns"):
    become_init()
layer("nnp", lambda: check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)), spec["nnp"])
layer("rlimits", set_rlimits, True)
layer("uid_drop", drop_uid, spec["uid"] is not None)
layer("chdir", lambda: os.chdir(wd), True)
if probe:
    say("layers " + json.dumps(done))
py = spec["python"]
try:
    boot = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'))"
    os.execve(py, [py, "-I", "-B", "-u", "-c", boot, spec["bootstrap"], wd, str(status), str(code_fd), spec["flags"]],
              dict(os.environ))
except OSError as e:
    say(f"error exec {py}: {e}")
    os._exit(125)
'''

# The bootstrap: first code of the sandbox interpreter, unprivileged, compiled as "<sandbox>".
# argv[2:]: workdir, status fd, code fd, flags ("net": refuse network, "strict": refuse programs and gc walks, "probe").
# The hook keeps its state in closures over builtins captured at start, so rebinding names in
# builtins or in modules later does not change what it checks.
_BOOTSTRAP = r'''
def _sandbox_hook(workdir, block_net, strict):
    import posix
    lstat, readlink, getcwd, getpid, fspath = posix.lstat, posix.readlink, posix.getcwd, posix.getpid, posix.fspath
    isinstance_, type_, str_, bytes_, int_, OSError_, PermissionError_ = (
        isinstance, type, str, bytes, int, OSError, PermissionError)
    write = posix.O_WRONLY | posix.O_RDWR | posix.O_APPEND | posix.O_CREAT | posix.O_TRUNC
    devices = frozenset(("/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/dev/stdout", "/dev/stderr",
                         "/dev/random", "/dev/urandom"))
    paths = {  # event -> ((index of a path argument, index of its dir_fd argument or None), ...)
        "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
        "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.symlink": ((1, 2),),
        "os.setxattr": ((0, None),), "os.removexattr": ((0, None),), "os.rename": ((0, 2), (1, 3)),
        "os.link": ((0, 2), (1, 3)), "shutil.rmtree": ((0, 1),), "sqlite3.connect": ((0, None),)}
    net = frozenset(("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"))
    dns = frozenset(("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"))
    spawn = frozenset(("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system"))
    walks = frozenset(("gc.get_objects", "gc.get_referrers", "gc.get_referents"))
    native = frozenset(("ctypes", "_ctypes", "cffi", "_cffi_backend"))
    frozen = frozenset(("__code__", "__defaults__", "__kwdefaults__"))

    def real(path, dir_fd):
        """os.path.realpath from captured primitives; missing components are kept as written."""
        if not path.startswith("/"):
            base = getcwd() if dir_fd is None or dir_fd < 0 else readlink("/proc/self/fd/%d" % dir_fd)
            path = base + "/" + path
        todo, out, hops = path.split("/")[::-1], "", 0
        while todo:
            part = todo.pop()
            if part == "" or part == ".":
                continue
            if part == "..":
                out = out[:out.rfind("/")]
                continue
            nxt = out + "/" + part
            try:
                mode = lstat(nxt).st_mode
            except OSError_:
                out = nxt
                continue
            if mode & 0o170000 != 0o120000:
                out = nxt
                continue
            hops += 1
            if hops > 40:
                raise OSError_("symlink loop")
            target = readlink(nxt)
            if target.startswith("/"):
                out = ""
            todo.extend(target.split("/")[::-1])
        return out or "/"

    def inside(path, dir_fd=None):
        if path is None or isinstance_(path, int_):
            return True  # an open file descriptor: opening it went through this hook
        path = fspath(path)
        path = "".join((path,)) if isinstance_(path, str_) else b"".join((path,)).decode("utf-8", "surrogateescape")
        if path in devices or path == ":memory:" or path == "":
            return True
        try:
            path = real(path, dir_fd)
        except OSError_:
            return False
        return path == workdir or path.startswith(workdir + "/")

    def other_process(path):
        """Is `path` in /proc/<pid>/ of another process (same uid: environ, mem, ... are readable)?"""
        try:
            parts = real(path, None).split("/")
        except OSError_:
            return True
        return len(parts) > 2 and parts[1] == "proc" and str_.isdigit(parts[2]) and parts[2] != "%d" % getpid()

    def deny(what, path=None):
        shown = " %r" % (path,) if type_(path) is str_ else ""
        raise PermissionError_(1, "sandbox: %s%s is not allowed" % (what, shown))

    def hook(event, args):
        if event == "open":
            if args[2] & write and not inside(args[0]):
                deny("writing outside the working directory:", args[0])
            if strict and type_(args[0]) is str_ and str_.startswith(args[0], "/proc/") and other_process(args[0]):
                deny("reading another process's /proc entry:", args[0])
        elif event in paths:
            for i, d in paths[event]:
                path = args[i]
                if event == "sqlite3.connect" and isinstance_(path, str_) and str_.startswith(path, "file:"):
                    path = str_.split(path[5:], "?")[0]  # a URI names the file sqlite will open
                if not inside(path, None if d is None else args[d]):
                    deny(event + " outside the working directory:", path)
        elif event in net:
            if block_net:
                addr = args[1]
                if addr is not None and not (  # None: sendmsg on a connected socket
                        isinstance_(addr, (str_, bytes_)) and addr[:1] not in ("\0", b"\0") and inside(addr)):
                    deny("network access (" + event + ")")
        elif event in dns:
            if block_net:
                deny("network access (" + event + ")")
        elif event == "object.__setattr__":
            if args[1] in frozen:
                for f in ours:
                    if args[0] is f:
                        deny("changing the sandbox's own functions")
        elif event == "import":
            if args[0] in native or args[0].startswith("ctypes."):
                deny("importing " + args[0])
        elif event.startswith("ctypes."):
            deny(event)
        elif strict and (event in spawn or event in walks):
            deny(event)

    ours = (hook, real, inside, other_process, deny)
    return hook


def _sandbox_main():
    import sys, posix
    workdir, status_fd, code_fd, flags = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5].split(",")
    sys.addaudithook(_sandbox_hook(workdir, "net" in flags, "strict" in flags))
    posix.set_inheritable(status_fd, False)
    if "probe" in flags:
        posix.write(status_fd, b"probe-ok\n")
        return
    chunks = []
    while True:
        chunk = posix.read(code_fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    posix.close(code_fd)
    source = b"".join(chunks).decode("utf-8", "surrogateescape")
    import linecache
    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")

    def excepthook(kind, value, tb, write=posix.write, hook=sys.__excepthook__):
        if issubclass(kind, MemoryError):
            try:
                write(status_fd, b"memory\n")
            except OSError:
                pass
        frames = []  # the traceback without the sandbox's own frames (bootstrap, audit hook)
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename
            if name != "<sandbox>" and not (name == "<string>" and not frames):
                frames.append(tb)
            tb = tb.tb_next
        for prev, nxt in zip(frames, frames[1:] + [None]):
            prev.tb_next = nxt
        hook(kind, value.with_traceback(frames[0] if frames else None), frames[0] if frames else None)

    sys.excepthook = excepthook
    sys.argv = ["-c"]
    sys.path.insert(0, workdir)
    main = sys.modules["__main__"].__dict__
    for name in [n for n in main if not n.startswith("__")]:
        del main[name]
    posix.write(status_fd, b"ready\n")
    exec(compile(source, "<code>", "exec", dont_inherit=True), main)


_sandbox_main()
'''
