"""`python`: run code in the sandbox (``tools_env.sandbox``), in ``<episode workdir>/python``.

Cost is ``price_per_s`` x the sandbox's wall seconds ($0.0000083/s, ToolOrchestra), latency is
those wall seconds. At most ``max_concurrency`` sandboxes run at once per process (queueing
beyond that; by default 8 per CPU on the warm path, 2 per CPU on the cold one), so 512 episodes
do not start 512 interpreters on a small machine. The sandbox
module is imported at the first call, so the service starts without it (``warm``, the default,
starts the sandbox's zygote there too); if it is missing the
call is an error observation. An exception in the user's code is an ordinary observation (its
traceback); a timeout or a kill by the sandbox is an error.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from tools_env.service_config import PythonConfig
from tools_env.tools.base import EpisodeContext, Tool, ToolResult, register_tool

MAX_CODE_CHARS = 100_000


def _format(result: Any) -> str:
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append("[timed out]")
    elif result.killed_reason:
        parts.append(f"[killed: {result.killed_reason}]")
    elif result.exit_code:
        parts.append(f"[exit code {result.exit_code}]")
    if result.truncated:
        parts.append("[output truncated]")
    return "\n".join(parts) if parts else "[no output]"


def sandbox_workdir(ctx: EpisodeContext) -> str:
    """The code's folder: ``<episode workdir>/python``, beside (never holding) the episode's domain
    databases, which only the domain tools read and write."""
    return os.path.join(ctx.workdir, "python")


def _require_fs_allowlist() -> None:
    """ValueError unless the sandbox shows the code only its allowlist of files (``python.require_fs_allowlist``)."""
    from tools_env.sandbox import sandbox_capabilities

    caps = sandbox_capabilities()
    if not caps["fs_allowlist"]:
        raise ValueError(
            "python.require_fs_allowlist is true, but this host's sandbox cannot hide the host's files from the code "
            f"(fs_allowlist: false; mount_namespace: {str(caps['mount_namespace']).lower()}): run the service as root "
            "or where unprivileged user namespaces are allowed, or set python.require_fs_allowlist: false"
        )


@register_tool
class Python(Tool):
    name = "python"
    description = (
        "Run a Python 3 program and see its stdout/stderr. Print what you want to see. No network; "
        "files persist in the working directory for this task. Costs $0.0000083 per second of execution."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete Python program"}},
        "required": ["code"],
    }

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        cfg = self.config.get("python")
        if cfg is None:
            cfg = PythonConfig()
        elif not isinstance(cfg, PythonConfig):
            cfg = PythonConfig.from_dict(cfg)
        self.cfg: PythonConfig = cfg
        # a warm run is a fork (copy-on-write) that spends part of its life waiting on the kernel
        self._slots = asyncio.Semaphore(cfg.max_concurrency or (8 if cfg.warm else 2) * (os.cpu_count() or 1))
        self._limits = None
        if cfg.require_fs_allowlist:
            _require_fs_allowlist()

    async def call(self, arguments: dict[str, Any], ctx: EpisodeContext) -> ToolResult:
        code = arguments["code"]
        if len(code) > MAX_CODE_CHARS:
            msg = f"code longer than {MAX_CODE_CHARS} characters"
            return ToolResult(observation=f"python error: {msg}", error=msg)
        try:
            from tools_env.sandbox import SandboxLimits, run_python
        except ImportError as e:
            msg = f"python tool unavailable: cannot import tools_env.sandbox ({e})"
            return ToolResult(observation=msg, error=msg)
        if self._limits is None:
            self._limits = SandboxLimits(**self.cfg.sandbox_limits())
        workdir = sandbox_workdir(ctx)
        os.makedirs(workdir, mode=0o700, exist_ok=True)
        async with self._slots:
            result = await run_python(code, workdir, self._limits, warm=self.cfg.warm)
        error = None
        if result.timed_out:
            error = "python: timed out"
        elif result.killed_reason:
            error = f"python: killed ({result.killed_reason})"
        return ToolResult(
            observation=_format(result),
            cost=result.wall_s * self.cfg.price_per_s,
            latency_s=result.wall_s,
            error=error,
            meta={"exit_code": result.exit_code, "truncated": result.truncated},
        )
