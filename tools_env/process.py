"""Process helpers shared by the service (``server``) and the supervisor that starts its workers
(``launch``): whether the starting process is gone, and the ready file a started service writes."""

from __future__ import annotations

import json
import os


def parent_gone(parent_pid: int) -> bool:
    """True once the process that started this one has exited (this one is then re-parented)."""
    return os.getppid() != parent_pid


def write_ready_file(path: str, urls: list[str]) -> None:
    """Atomically write ``{"urls": [...], "pid": ...}`` to ``path``: a launcher polls for it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"urls": urls, "pid": os.getpid()}, f)
    os.replace(tmp, path)
