"""What one run may use: `SandboxLimits`, checked when it is built."""

from __future__ import annotations

from dataclasses import dataclass


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
