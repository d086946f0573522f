"""`run_python`: plan, prepare, start (warm: a zygote's child; cold: a fresh launcher), capture,
and kill everything of the run at the end."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid

from tools_env.sandbox.cgroup import _Cgroup
from tools_env.sandbox.cleanup import _kill_strays, _killpg
from tools_env.sandbox.limits import SandboxLimits
from tools_env.sandbox.output import SandboxResult, _Capture, _read_status, _result
from tools_env.sandbox.plan import _Plan
from tools_env.sandbox.probe import _PLANS, _disabled, _get_plan
from tools_env.sandbox.prepare import (
    _check_workdir,
    _launch_spec,
    _launcher_argv,
    _next_uid,
    _prepare,
    _prepare_is_quick,
    _sandbox_env,
)
from tools_env.sandbox.warm import _ZYGOTES, _WarmRun, _ZygoteGone, _zygote_for


async def run_python(
    code: str, workdir: str, limits: SandboxLimits = SandboxLimits(), *, warm: bool = True
) -> SandboxResult:
    """Run `code` in the sandbox with `workdir` as its only writable place; never raises for what
    the code does. `warm=False` skips the zygote and starts fresh interpreters (the cold path,
    also the fallback when no zygote can be set up); the layers are the same either way."""
    key = _disabled()
    plan = _PLANS.get(key) or await asyncio.to_thread(_get_plan)
    wd, closed = _check_workdir(workdir, plan)
    uid = _next_uid() if plan.layers["uid_drop"] else None
    marker = uuid.uuid4().hex
    if _prepare_is_quick(wd, uid, plan):  # a thread hop costs more CPU than a few chowns
        nproc = _prepare(wd, uid, plan, limits)
    else:
        nproc = await asyncio.to_thread(_prepare, wd, uid, plan, limits)
    spec = _launch_spec(plan, wd, uid, limits, nproc, closed)
    cgroup = _Cgroup.create(plan.cgroup_base, marker, limits)
    loop = asyncio.get_running_loop()
    proto = _Capture(loop, limits.max_output_bytes)
    source = code.encode("utf-8", "surrogateescape")
    t0 = time.monotonic()
    try:
        run = await _start_warm(key, plan, spec, marker, source, cgroup, proto) if warm else None
        if run is None:
            run, cgroup = await _start_cold(spec, marker, source, cgroup, proto)
    except BaseException:
        if cgroup:
            cgroup.remove()
        raise
    reason = None
    try:
        reason = await proto.wait(limits.wall_time_s - (time.monotonic() - t0))
    finally:
        wall_s = time.monotonic() - t0
        # shielded: a cancelled caller still gets every process of the run killed
        status, oom = await asyncio.shield(asyncio.ensure_future(_finish(run, proto, cgroup, uid, marker)))
    return _result(proto, run.returncode(), reason, status, oom, wall_s, limits)


async def _start_warm(
    key: str, plan: _Plan, spec: dict, marker: str, source: bytes, cgroup: _Cgroup | None, proto: _Capture
) -> _WarmRun | None:
    """The run as a child of the plan's zygote; None when there is no zygote (the cold path runs it).
    A zygote found dead when the run is sent is replaced once."""
    if key in _ZYGOTES and _ZYGOTES[key] is None:
        return None  # no warm path on this host (logged once)
    zygote = _ZYGOTES.get(key)
    if zygote is None or not zygote.alive():
        zygote = await asyncio.to_thread(_zygote_for, key, plan)
    env = _sandbox_env(spec["workdir"], marker)
    for attempt in range(2):
        if zygote is None:
            return None
        try:
            fds = zygote.send_run(marker, spec, env, cgroup and cgroup.path, source)
            return _WarmRun(asyncio.get_running_loop(), proto, zygote, marker, fds)
        except _ZygoteGone:
            zygote = await asyncio.to_thread(_zygote_for, key, plan, zygote) if attempt == 0 else None
    return None


class _ColdRun:
    """A launcher subprocess, seen through the same methods as `_WarmRun`."""

    def __init__(self, transport: asyncio.SubprocessTransport, status_r: int):
        self.transport, self.status_r = transport, status_r

    def returncode(self) -> int | None:
        return self.transport.get_returncode()

    def kill_group(self) -> None:
        _killpg(self.transport.get_pid())

    def close(self) -> None:
        self.transport.close()


async def _start_cold(
    spec: dict, marker: str, source: bytes, cgroup: _Cgroup | None, proto: _Capture
) -> tuple[_ColdRun, _Cgroup | None]:
    """Start the launcher, put it in the run's cgroup (or drop the cgroup), hand it the code."""
    loop = asyncio.get_running_loop()
    status_r, spec["status_fd"] = os.pipe()
    try:
        transport, _ = await loop.subprocess_exec(
            lambda: proto,
            *_launcher_argv(spec),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(spec["status_fd"],),
            start_new_session=True,
            env=_sandbox_env(spec["workdir"], marker),
            cwd=spec["workdir"],
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(spec["status_fd"])
    if cgroup and not cgroup.add(transport.get_pid()):  # before the code is sent: the launcher waits for it
        cgroup.remove()
        cgroup = None
    stdin = transport.get_pipe_transport(0)
    stdin.write(source)
    stdin.close()
    return _ColdRun(transport, status_r), cgroup


async def _finish(
    run: _WarmRun | _ColdRun, proto: _Capture, cgroup: _Cgroup | None, uid: int | None, marker: str
) -> tuple[list[str], bool]:
    """Kill every process of the run, collect the rest of its output and its status lines.
    A cgroup that could be removed was empty: no process of the run is left anywhere, since they
    all descend from its first process, which joined it before anything else, and the run's uid
    cannot move a process out. Without one, the run's processes are searched by uid or marker."""
    if cgroup:
        cgroup.kill()
    run.kill_group()
    oom = bool(cgroup and cgroup.oom_killed())
    if not (cgroup and await cgroup.remove_async()):
        await asyncio.to_thread(_kill_strays, uid, marker)
    await proto.drained(1.0)
    run.close()
    return _read_status(run.status_r), oom


def run_python_sync(
    code: str, workdir: str, limits: SandboxLimits = SandboxLimits(), *, warm: bool = True
) -> SandboxResult:
    """`run_python` for callers without an event loop (not from inside a running loop)."""
    return asyncio.run(run_python(code, workdir, limits, warm=warm))
