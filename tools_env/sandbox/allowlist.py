"""The file-system allowlist: what a run's root holds (read-only) when the code gets a root of its own.

With the `fs_allowlist` layer, layers.py builds each run a fresh root (a tmpfs) holding only:
  * /usr, read-only: the sandbox interpreter, its standard library and packages, the shared
    libraries and programs (Debian's python3 and its dist-packages live there); /bin, /lib,
    /lib64 and /sbin as on the host (symlinks into /usr where the host has merged /usr, else
    read-only binds);
  * the sandbox interpreter's own folders when they are outside /usr (a venv, pyenv, conda:
    sys.prefix, sys.base_prefix and sys.path as that interpreter reports them under -I), read-only;
  * /etc: a copy, made once per process, of the few host files an interpreter reads (ld.so.cache
    and its config, localtime, mime.types, alternatives, ssl/certs), read-only; no passwd, group,
    hosts, or any other host configuration;
  * /dev: null, zero, full, random, urandom (bound from the host), fd/stdin/stdout/stderr
    (symlinks into /proc/self/fd) and a private /dev/shm;
  * /proc: the run's own (private_proc); /tmp: an empty, read-only tmpfs;
  * the run's workdir at its own path (parent folders are empty, searchable directories).
Nothing else of the host: no /home or /root, no checkout, no task files, run folders or
checkpoints, no other episode's workdir, no service configuration or token, no /sys, /run, /var.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import tempfile

_TOP = ("bin", "lib", "lib32", "lib64", "libx32", "sbin")  # beside /usr; symlinks into it on merged-/usr hosts
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "mime.types", "alternatives", "ssl/certs")
_DEVICES = ("null", "zero", "full", "random", "urandom")


def _python_dirs(python: str) -> list[str]:
    """The folders the interpreter `python` imports from (run once, under -I as the sandbox runs it)."""
    probe = "import sys, json; print(json.dumps([sys.prefix, sys.exec_prefix, sys.base_prefix, *sys.path]))"
    out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"{python} -I -c ... failed: {out.stderr.strip()[-200:]}")
    dirs = [os.path.realpath(p) for p in json.loads(out.stdout) if p]
    return [d for d in dirs if os.path.isdir(d)]


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _etc_copy() -> str:
    """A folder holding copies of the allowed /etc entries (symlinks kept as symlinks), removed at exit."""
    etc = tempfile.mkdtemp(prefix="nemo-sandbox-etc-")
    atexit.register(shutil.rmtree, etc, True)
    os.chmod(etc, 0o755)
    for name in _ETC:
        src, dst = os.path.join("/etc", name), os.path.join(etc, name)
        if not os.path.lexists(src):
            continue
        os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True)
        elif os.path.isfile(src):
            shutil.copy2(src, dst)
    for dirpath, dirnames, filenames in os.walk(etc):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)
        for f in filenames:
            if not os.path.islink(os.path.join(dirpath, f)):
                os.chmod(os.path.join(dirpath, f), 0o644)
    return etc


@functools.lru_cache(maxsize=None)
def host_allowlist(python: str) -> dict:
    """What a run's root holds for the sandbox interpreter `python`, as layers.py reads it:
    "ro": host folders bound read-only at the same path; "links": [path, target] symlinks;
    "etc": the folder bound read-only at /etc; "devices": host device nodes bound in /dev."""
    ro = ["/usr"]
    links = []
    for name in _TOP:
        path = "/" + name
        if os.path.islink(path):
            links.append([path, os.readlink(path)])
        elif os.path.isdir(path):
            ro.append(path)
    for d in _python_dirs(python):
        if d != "/" and not _under(d, ro):
            ro = [r for r in ro if not _under(r, [d])] + [d]
    devices = [f"/dev/{n}" for n in _DEVICES if os.path.exists(f"/dev/{n}")]
    return {"ro": sorted(ro), "links": links, "etc": _etc_copy(), "devices": devices}


def allowlist_conflict(workdir: str, allow: dict) -> str | None:
    """Why `workdir` cannot be a run's writable folder under this allowlist, or None."""
    if workdir == "/" or workdir.split("/")[1] in ("proc", "dev", "etc"):
        return f"{workdir} is where the sandbox mounts its own /, /proc, /dev or /etc"
    clash = next((r for r in allow["ro"] if _under(workdir, [r]) or _under(r, [workdir])), None)
    if clash is not None:
        return f"{workdir} overlaps {clash}, which the sandbox shows read-only"
    return None
