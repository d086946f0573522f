"""Start the tool service as a subprocess (``start_service``) and run several workers (``--workers N``).

    with start_service({"guards": {"max_turns": 10}}, workers=2) as svc:
        client = ToolsEnvClient(svc.urls, token=svc.token)

Workers: ``--workers N`` starts N independent worker processes, each on its own port
(port..port+N-1, or N free ports when port is 0) with its own episode table, under one
supervisor process. They are replicas: ``.urls`` lists them all and ``ToolsEnvClient`` routes
each episode to one of them by its id. (One port shared through SO_REUSEPORT would have the
kernel spread *connections*, so a step could land on a worker that does not hold the episode;
making that work needs forwarding or shared state, each a hop and a failure mode more.) If a
worker dies the supervisor stops the others and exits, rather than serve with a hole.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServiceStartError(RuntimeError):
    pass


class ServiceHandle:
    """A running service: ``.urls`` (one per worker), ``.token``, ``.stop()``, ``.restart()``; a
    context manager."""

    def __init__(
        self, process: subprocess.Popen, urls: list[str], token: str | None, tmpdir: str, workdir: str | None = None
    ):
        self.process, self.urls, self.token, self.tmpdir = process, urls, token, tmpdir
        self.workdir = workdir  # the workers' episode folders, when this handle made their root
        self.log_path = os.path.join(tmpdir, "server.log")
        self.relaunch: Any = None  # start_service with this service's arguments (set by start_service)
        self.restarts = 0

    def alive(self) -> bool:
        return self.process.poll() is None

    def restart(self) -> list[str]:
        """Stop what is left of this service and start it again with the same config, workers and
        token (on fresh free ports unless a port was given); returns the new URLs. Its episodes are
        gone: callers retry whatever ran on it."""
        assert self.relaunch is not None, "restart() needs a handle made by start_service"
        self.stop()
        fresh = self.relaunch()
        self.process, self.urls, self.tmpdir, self.log_path = fresh.process, fresh.urls, fresh.tmpdir, fresh.log_path
        self.workdir = fresh.workdir
        self.restarts += 1
        return self.urls

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n_chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the service's whole process group (SIGTERM, then SIGKILL)."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout_s)
        _signal_group(self.process.pid, signal.SIGKILL)  # stragglers of the group, if any
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        if self.workdir:  # what workers killed before their own clean-up left
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "ServiceHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_service(
    config: dict | None = None,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    workers: int = 1,
    token: str | None = None,
    timeout_s: float = 30.0,
    log_level: str = "WARNING",
) -> ServiceHandle:
    """Start ``python -m tools_env.server`` in its own process group and wait until every worker
    answers ``/healthz``. ``port=None`` picks free ports. Raises ``ServiceStartError`` with the
    tail of the server's log if it does not come up within ``timeout_s``."""
    from tools_env.service_config import ServiceConfig

    ServiceConfig.from_dict(config or {})  # a bad config fails here, with its message, not in a log file
    tmpdir = tempfile.mkdtemp(prefix="tools_env-launch-")
    workdir = None
    served = dict(config or {})
    if served.get("workdir_root") is None:  # the workers' episode folders under one root this handle removes
        workdir = tempfile.mkdtemp(prefix="tools_env-work-")
        os.chmod(workdir, 0o711)  # the sandbox's dropped uid must traverse it; nobody may list it
        served["workdir_root"] = workdir
    config_path = os.path.join(tmpdir, "config.json")
    ready_path = os.path.join(tmpdir, "ready.json")
    with open(config_path, "w") as f:
        json.dump(served, f)
    env = dict(os.environ)
    env.pop("TOOLS_ENV_TOKEN", None)
    if token:
        env["TOOLS_ENV_TOKEN"] = token  # not on the command line, where `ps` would show it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "tools_env.server",
        "--host",
        host,
        "--port",
        str(port or 0),
        "--workers",
        str(workers),
        "--config",
        config_path,
        "--ready-file",
        ready_path,
        "--log-level",
        log_level,
        "--exit-with-parent",
        "--orphan-cleanup",
        tmpdir,
    ] + (["--orphan-cleanup", workdir] if workdir else [])
    # a launcher killed by SIGKILL (no cleanup runs) leaves neither the service nor its folders behind
    with open(os.path.join(tmpdir, "server.log"), "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    handle = ServiceHandle(proc, [], token, tmpdir, workdir)
    handle.relaunch = lambda: start_service(
        config, host=host, port=port, workers=workers, token=token, timeout_s=timeout_s, log_level=log_level
    )
    try:
        handle.urls = _wait_ready(proc, ready_path, time.monotonic() + timeout_s)
    except ServiceStartError as e:
        tail = handle.log_tail()
        handle.stop()
        raise ServiceStartError(f"{e}\n--- server log tail ---\n{tail}") from None
    return handle


def _wait_ready(proc: subprocess.Popen, ready_path: str, deadline: float) -> list[str]:
    while not os.path.exists(ready_path):
        if proc.poll() is not None:
            raise ServiceStartError(f"tool service exited with code {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise ServiceStartError("tool service did not become ready in time")
        time.sleep(0.02)
    with open(ready_path) as f:
        urls = json.load(f)["urls"]
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServiceStartError(f"{url}/healthz did not answer")
            time.sleep(0.02)
    return urls


# ---- the multi-worker supervisor (python -m tools_env.server --workers N) --------------------


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def supervise_workers(args: Any, token: str | None) -> int:
    """Start ``args.workers`` workers, write the ready file, and wait (until SIGTERM/SIGINT, a worker
    exits, or, with ``--exit-with-parent``, the process that started this one is gone); returns the
    exit code. The workers die with the supervisor (PR_SET_PDEATHSIG on Linux)."""
    from tools_env.process import parent_gone, remove_if_orphaned

    env = dict(os.environ)
    if token:
        env["TOOLS_ENV_TOKEN"] = token
    children = []
    for k in range(args.workers):
        cmd = [
            sys.executable,
            "-m",
            "tools_env.server",
            "--host",
            args.host,
            "--port",
            str(0 if args.port == 0 else args.port + k),
            "--worker-index",
            str(k),
            "--log-level",
            args.log_level,
        ] + (["--config", args.config] if args.config else [])
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        children.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, preexec_fn=preexec)
        )
    stopping = threading.Event()

    def stop_all(*_: Any) -> None:
        stopping.set()
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    ready: queue.Queue = queue.Queue()

    def relay(k: int, c: subprocess.Popen) -> None:
        """The READY line to us, everything after it to our stdout: a full pipe would block the worker."""
        ready.put((k, c.stdout.readline().decode()))
        for line in c.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()

    for k, c in enumerate(children):
        threading.Thread(target=relay, args=(k, c), daemon=True).start()
    urls: list[str | None] = [None] * len(children)
    deadline = time.monotonic() + 120
    while None in urls and not stopping.is_set():
        try:
            k, line = ready.get(timeout=0.1)
        except queue.Empty:
            if time.monotonic() > deadline or any(c.poll() is not None for c in children):
                print("error: a worker failed to start", file=sys.stderr)
                stop_all()
                return 1
            continue
        if not line.startswith("READY "):
            print(f"error: worker {k} failed to start", file=sys.stderr)
            stop_all()
            return 1
        urls[k] = line.split()[1]
    if not stopping.is_set():
        if args.ready_file:
            from tools_env.process import write_ready_file

            write_ready_file(args.ready_file, urls)
        for url in urls:
            print(f"READY {url}", flush=True)
    code = 0
    while not stopping.is_set():
        if getattr(args, "parent_pid", None) and parent_gone(args.parent_pid):
            print(f"the process that started this service (pid {args.parent_pid}) is gone: stopping", file=sys.stderr)
            stop_all()
            break
        dead = [c for c in children if c.poll() is not None]
        if dead:
            print(f"error: worker pid {dead[0].pid} exited with code {dead[0].returncode}; stopping", file=sys.stderr)
            code = 1
            stop_all()
        time.sleep(0.2)
    for c in children:
        try:
            c.wait(10)
        except subprocess.TimeoutExpired:
            c.kill()
    remove_if_orphaned(getattr(args, "parent_pid", None), getattr(args, "orphan_cleanup", []))
    return code
