"""Process helpers shared by the service (``server``) and the supervisor that starts its workers
(``launch``): whether the starting process is gone, the ready file a started service writes, and the
folders an orphaned service removes."""

from __future__ import annotations

import json
import os
import shutil


def parent_gone(parent_pid: int) -> bool:
    """True once the process that started this one has exited (this one is then re-parented)."""
    return os.getppid() != parent_pid


def write_ready_file(path: str, urls: list[str]) -> None:
    """Atomically write ``{"urls": [...], "pid": ...}`` to ``path``: a launcher polls for it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"urls": urls, "pid": os.getpid()}, f)
    os.replace(tmp, path)


def remove_if_orphaned(parent_pid: int | None, folders: list[str]) -> None:
    """``folders`` (made for this service by the process that started it) removed when that process is
    gone: no one else is left to remove them."""
    if parent_pid and parent_gone(parent_pid):
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
