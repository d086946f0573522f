"""Helpers for the sandbox tests (a unique module name: tests folders are not packages)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess

from tools_env.sandbox import SandboxLimits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FAST = SandboxLimits(cpu_time_s=1, wall_time_s=5, memory_mb=256, max_processes=8, max_output_bytes=4096, file_size_mb=1)


def alive(pid: int) -> bool:
    """Is `pid` a live (non-zombie) process?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def live_pids_with(token: str) -> list[int]:
    """Host pids of live (non-zombie) processes whose command line contains `token`."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if token.encode() not in f.read():
                    continue
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in "ZX":
                    found.append(int(name))
        except OSError:
            continue
    return found


def live_pids_holding(token: str) -> list[int]:
    """Host pids of live processes with a file whose path contains `token` open."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{name}/fd/{fd}") for fd in os.listdir(f"/proc/{name}/fd")]
            with open(f"/proc/{name}/stat") as f:
                alive = f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
        except OSError:
            continue
        if alive and any(token in link for link in links):
            found.append(int(name))
    return found


def live_pids_of_uid(uid: int) -> list[int]:
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/status") as f:
                st = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        except OSError:
            continue
        if st["Uid"].split()[0] == str(uid) and st["State"][0] not in "ZX":
            found.append(int(name))
    return found


def copy_package(parent: str) -> str:
    """Copy the tools_env package to `parent`/checkout; returns the folder to put on sys.path."""
    root = os.path.join(parent, "checkout")
    shutil.copytree(
        os.path.join(REPO, "tools_env"),
        os.path.join(root, "tools_env"),
        ignore=shutil.ignore_patterns("__pycache__", "corpus"),
    )
    return root


def run_as_nobody(python: str, driver: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``python -I -c driver`` as the user ``nobody`` (no supplementary groups), from /, with only ``env``."""
    nobody = pwd.getpwnam("nobody")
    return subprocess.run(
        [python, "-I", "-c", driver],
        user=nobody.pw_uid,
        group=nobody.pw_gid,
        extra_groups=[],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=timeout,
    )
