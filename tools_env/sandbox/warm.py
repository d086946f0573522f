"""The warm path: one zygote per sandbox plan (zygote.py), forking a single-use child per run.

The cold path pays, per run, for two interpreter starts (the launcher, then the sandbox
interpreter) and their imports. The zygote is the sandbox interpreter started once, with the
layers' and the bootstrap's imports done; a run is a fork of it that enters the same layers in the
same order (layers.py) and runs the same bootstrap, so the isolation is the launcher's: its own
pid, network and mount namespaces, cgroup and fresh uid per run (as root, the network namespace is
an empty one lent from the zygote's pool, never to two runs at once). The zygote never runs code, so
nothing a run does (files, modules, globals, environment, processes) reaches the next one.

It is started at the first warm run of a plan and checked with a probe run that must enter
exactly the layers `sandbox_capabilities()` reports; if it cannot start, or its layers differ, the
plan's runs use the cold path for the life of the process (logged once). A zygote that died is
restarted at the next run. It exits when this process is gone (its socket reaches EOF, or its
parent changes), however this process died.

What the runs of one zygote share, unlike fresh interpreters: the string hash seed and the address
layout (ASLR) of the interpreter, both drawn once per zygote. No run can change either.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import uuid
from dataclasses import dataclass

from tools_env.sandbox.cleanup import _MARKER_VAR, _kill_strays
from tools_env.sandbox.limits import SandboxLimits
from tools_env.sandbox.output import _Capture, _read_status
from tools_env.sandbox.plan import _Plan
from tools_env.sandbox.prepare import (
    _BOOTSTRAP,
    _ZYGOTE,
    _launch_spec,
    _next_uid,
    _nproc_limit,
    _sandbox_env,
    _take_ownership,
)

logger = logging.getLogger(__name__)

_BOOT = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'))"
_MARKER_SLOT = "0" * 32  # the zygote's marker value; each child writes its run's (uuid4().hex) over it
_START_TIMEOUT_S = 30.0
_SEND_TIMEOUT_S = 5.0  # a zygote that takes no message for this long is replaced


class _ZygoteGone(Exception):
    """The zygote did not take a message: it died, or hangs."""


@dataclass
class _RunFds:
    """This process's ends of one run's pipes."""

    out: int
    err: int
    status: int
    exit: int  # the wait status of the code, as text, then EOF


class _Zygote:
    def __init__(self, proc: subprocess.Popen, sock: socket.socket):
        self.proc, self.sock = proc, sock

    @classmethod
    def start(cls, plan: _Plan) -> _Zygote:
        """Start a zygote for `plan` and check its layers with a probe run; raises if either fails."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [
                    plan.python,
                    "-I",
                    "-B",
                    "-u",
                    "-c",
                    _BOOT,
                    _ZYGOTE,
                    _BOOTSTRAP,
                    json.dumps({"sock": theirs.fileno()}),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                env=_sandbox_env("/", _MARKER_SLOT),
                cwd="/",
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        zygote = cls(proc, ours)
        try:
            ours.settimeout(_START_TIMEOUT_S)
            if ours.recv(16) != b"ready":
                raise RuntimeError(f"the zygote ({plan.python}) exited at start")
            ours.settimeout(_SEND_TIMEOUT_S)
            zygote._check_layers(plan)
        except BaseException:
            zygote.stop()
            raise
        return zygote

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send_run(self, run_id: str, spec: dict, env: dict[str, str], cgroup: str | None, code: bytes) -> _RunFds:
        """Ask for a child running `spec` in the (empty) cgroup directory `cgroup`; returns this
        side's pipe ends. Raises _ZygoteGone if the zygote did not take it."""
        assert len(env[_MARKER_VAR]) == len(_MARKER_SLOT)
        job = {
            "spec": {k: v for k, v in spec.items() if k != "bootstrap"},
            "env": env,
            "cgroup": cgroup and os.path.join(cgroup, "cgroup.procs"),
            "marker": None if spec["uid"] is not None else f"{_MARKER_VAR}={env[_MARKER_VAR]}",
        }
        code_fd = os.memfd_create("sandbox-code")
        os.write(code_fd, code)
        os.lseek(code_fd, 0, os.SEEK_SET)
        pipes = [os.pipe() for _ in range(4)]
        theirs = [code_fd] + [w for _, w in pipes]
        if cgroup:  # the zygote forks the child straight into it
            theirs.append(os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        try:
            born = ",".join(name for name in ("userns", "netns", "pidns") if spec[name])
            socket.send_fds(self.sock, [f"run {run_id} {born}\n{json.dumps(job)}".encode()], theirs)
        except BaseException as e:
            for r, _ in pipes:
                _close(r)
            if isinstance(e, OSError):
                raise _ZygoteGone(str(e)) from e
            raise
        finally:
            for fd in theirs:
                _close(fd)
        return _RunFds(*(r for r, _ in pipes))

    def done(self, run_id: str) -> None:
        """The run is over: the zygote SIGKILLs its child's process group and reaps the child."""
        try:
            self.sock.send(b"done " + run_id.encode())
        except OSError:
            pass  # gone: the child was reparented and is reaped by init

    def stop(self) -> None:
        self.sock.close()
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def _check_layers(self, plan: _Plan) -> None:
        """A probe run through this zygote must enter exactly the plan's layers (the cold probe's)."""
        wd = tempfile.mkdtemp(prefix="nemo-sandbox-zygote-", dir="/tmp" if os.path.isdir("/tmp") else None)
        uid = _next_uid() if plan.layers["uid_drop"] else None
        run_id = uuid.uuid4().hex
        try:
            _take_ownership(wd, uid)
            spec = _launch_spec(plan, wd, uid, SandboxLimits(), _nproc_limit(plan, uid, 16), None, probe=True)
            fds = self.send_run(run_id, spec, _sandbox_env(wd, run_id), None, b"")
            ready = select.select([fds.exit], [], [], _START_TIMEOUT_S)[0]
            ended = os.read(fds.exit, 32) if ready else b"timeout"
            status = _read_status(fds.status)
            for fd in (fds.out, fds.err, fds.exit):
                _close(fd)
        finally:
            self.done(run_id)
            _kill_strays(uid, run_id)
            shutil.rmtree(wd, ignore_errors=True)
        entered = next((json.loads(line[7:]) for line in status if line.startswith("layers ")), {})
        got = {k: bool(entered.get(k)) for k in plan.layers}
        if "probe-ok" not in status or got != plan.layers:
            raise RuntimeError(
                f"its probe run entered {got}, the cold probe {plan.layers} (status {status}, exit {ended!r})"
            )


class _WarmRun:
    """This side of one run in a zygote's child: stdout/stderr feed the capture, the exit pipe
    gives the code's wait status (the child ends without one only when it is SIGKILLed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, proto: _Capture, zygote: _Zygote, run_id: str, fds: _RunFds):
        self.loop, self.proto, self.zygote, self.run_id, self.fds = loop, proto, zygote, run_id, fds
        self.status_r = fds.status
        self._rc: int | None = None
        self._exit = b""
        self._open = {fds.out: 1, fds.err: 2, fds.exit: 0}
        for fd in self._open:
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._readable, fd)

    def _readable(self, fd: int) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            if fd == self.fds.exit:
                self._exit += data
            else:
                self.proto.pipe_data_received(self._open[fd], data)
            return
        self.loop.remove_reader(fd)
        del self._open[fd]
        _close(fd)
        if fd == self.fds.exit:
            self._rc = os.waitstatus_to_exitcode(int(self._exit)) if self._exit.isdigit() else -signal.SIGKILL
            self.proto.process_exited()
        if not self._open:
            self.proto.connection_lost(None)

    def returncode(self) -> int | None:
        return self._rc

    def kill_group(self) -> None:
        self.zygote.done(self.run_id)

    def close(self) -> None:
        for fd in list(self._open):
            self.loop.remove_reader(fd)
            _close(fd)
        self._open.clear()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


_ZYGOTES: dict[str, _Zygote | None] = {}  # plan key -> live zygote, or None: the warm path is off for it
_ZYGOTE_LOCK = threading.Lock()


def _zygote_for(key: str, plan: _Plan, replace: _Zygote | None = None) -> _Zygote | None:
    """The plan's live zygote, started (or restarted, when `replace` is the current one, or it
    died) if needed; None when the warm path cannot be set up here (runs then use the cold path)."""
    with _ZYGOTE_LOCK:
        if key in _ZYGOTES and _ZYGOTES[key] is None:
            return None
        current = _ZYGOTES.get(key)
        if current is not None and current.alive() and current is not replace:
            return current
        if current is not None:
            logger.warning(
                "sandbox: zygote %d is gone (exit %s); starting another", current.proc.pid, current.proc.poll()
            )
            current.stop()
        try:
            _ZYGOTES[key] = _Zygote.start(plan)
        except Exception as e:
            _ZYGOTES[key] = None
            logger.warning("sandbox: warm path unavailable, every run starts fresh interpreters (cold path): %s", e)
        return _ZYGOTES[key]


@atexit.register
def _stop_zygotes() -> None:
    with _ZYGOTE_LOCK:
        for zygote in filter(None, _ZYGOTES.values()):
            zygote.stop()
        _ZYGOTES.clear()
