"""One run's output: stdout+stderr up to the cap, the status lines, and the `SandboxResult` made of them."""

from __future__ import annotations

import asyncio
import math
import os
import signal
from dataclasses import dataclass

from tools_env.sandbox.limits import SandboxLimits

_SETUP_FAILED = 125  # launcher exit status when a promised layer could not be entered


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when the sandbox killed the run; negative: killed by that signal
    timed_out: bool  # killed_reason is "wall_time" or "cpu_time"
    killed_reason: str | None  # wall_time, cpu_time, memory, output_limit, signal, sandbox_error, None
    wall_s: float
    truncated: bool


class _Capture(asyncio.SubprocessProtocol):
    """Keeps the first `cap` bytes of stdout+stderr and drops the rest as it arrives."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cap: int):
        self.cap, self.out, self.truncated = cap, {1: bytearray(), 2: bytearray()}, False
        self.exited, self.overflow, self.closed = loop.create_future(), loop.create_future(), loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        room = self.cap - len(self.out[1]) - len(self.out[2])
        self.out[fd] += data[: max(room, 0)]
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


def _result(
    proto: _Capture,
    rc: int | None,
    reason: str | None,
    status: list[str],
    oom: bool,
    wall_s: float,
    limits: SandboxLimits,
) -> SandboxResult:
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
        stdout=proto.out[1].decode("utf-8", "replace"),
        stderr=stderr,
        exit_code=None if killed_by_us else rc,
        timed_out=reason in ("wall_time", "cpu_time"),
        killed_reason=reason,
        wall_s=round(wall_s, 3),
        truncated=proto.truncated,
    )
