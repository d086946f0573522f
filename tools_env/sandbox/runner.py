"""`run_python`: plan, prepare, launch, capture, and kill everything of the run at the end."""

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
from tools_env.sandbox.probe import _PLANS, _disabled, _get_plan
from tools_env.sandbox.prepare import _check_workdir, _launch_spec, _launcher_argv, _next_uid, _prepare, _sandbox_env


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
