"""Nothing a run starts outlives it: a watcher process that ends the run's processes when it ends.

A run's processes are many and not all ours: vLLM's engine core and workers, multiprocessing's
resource tracker, Megatron's checkpoint writer, the tool service, their spawn children. A parent
killed by SIGKILL runs no cleanup, and a parent-death signal only reaches a direct child that
armed it. So the main job marks itself instead, before anything starts:

1. ``contain()`` re-executes the job (same pid, same arguments) with ``NEMO_ORCHESTRA_RUN=<token>``
   and ``TMPDIR=<a folder of its own>`` in its environment. Every process it starts, forked or
   spawned, inherits both: the marker is visible in ``/proc/<pid>/environ`` of each of them, and
   their temporary folders (``tools_env-*``, vLLM's start-up folder, ...) land in the run's folder.
2. It starts this module as a watcher in a session of its own (Ctrl-C in the terminal does not
   reach it; it is not marked). The watcher waits for the job's pid to end (a pidfd: it learns
   at once, whatever the cause), then sends SIGTERM to every process carrying the job's marker,
   SIGKILL to those still there after ``GRACE_S`` (resource trackers last: they unlink the shared
   memory the others left), removes the run's temporary folders (``TMPDIR`` and one in /dev/shm,
   ``NEMO_ORCHESTRA_RUN_SHM``, for the vLLM engine's weight files), and exits.

This needs no cooperation from the children and no privilege; it covers every process of the
user that kept the job's environment (a child that clears its environment, such as the tool
service's sandboxed code, dies with its parent by its own parent-death signal). Linux only:
elsewhere ``contain()`` does nothing.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

RUN_ENV = "NEMO_ORCHESTRA_RUN"
TMP_ENV = "NEMO_ORCHESTRA_RUN_TMP"
SHM_ENV = "NEMO_ORCHESTRA_RUN_SHM"
PREFIX = "nor-"  # short: multiprocessing puts socket paths (at most 107 bytes) inside it
MAX_BASE = 40
GRACE_S = 2.0  # between SIGTERM and SIGKILL: a tool service removes its folders, vLLM its shared memory


def contained() -> bool:
    """Whether this process is a contained job (``contain()`` re-executed it)."""
    return os.environ.get(RUN_ENV, "").startswith(f"{os.getpid()}-")


def contain() -> None:
    """Call first in a job's ``__main__``: re-execute it marked (once), then start its watcher."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
        return
    if not contained():
        token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp, shm = run_tmpdir(token), run_shmdir(token)
        except OSError as e:  # no writable temporary folder: run uncontained rather than not at all
            print(f"warning: processes of this run may outlive it: no run folder ({e})", file=sys.stderr)
            return
        env = dict(os.environ)
        # compile caches keep their usual place: a run's temporary folder is removed when it ends
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{_user()}"))
        env.update({RUN_ENV: token, TMP_ENV: tmp, "TMPDIR": tmp} | ({SHM_ENV: shm} if shm else {}))
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    env = {k: v for k, v in os.environ.items() if k not in (RUN_ENV, "TMPDIR")}
    folders = [os.environ[k] for k in (TMP_ENV, SHM_ENV) if os.environ.get(k)]
    subprocess.Popen(
        [sys.executable, "-m", "nemo_orchestra.runtime.reaper", str(os.getpid()), os.environ[RUN_ENV], *folders],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def run_tmpdir(token: str) -> str:
    """The run's temporary folder: under the usual one, or /tmp when that path is so long that
    multiprocessing's socket paths inside it would pass the 107-byte AF_UNIX limit."""
    base = tempfile.gettempdir()
    if len(base) > MAX_BASE and os.access("/tmp", os.W_OK):
        base = "/tmp"
    return tempfile.mkdtemp(prefix=f"{PREFIX}{token}-", dir=base)


def run_shmdir(token: str) -> str | None:
    """The run's folder in /dev/shm (``NEMO_ORCHESTRA_RUN_SHM``: the vLLM engine's weight-sync
    files), removed with the run; None without a writable /dev/shm."""
    if not os.access("/dev/shm", os.W_OK):
        return None
    return tempfile.mkdtemp(prefix=f"{PREFIX}{token}-", dir="/dev/shm")


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except Exception:
        return str(os.getuid())


def marked(token: str, exclude: int | None = None) -> list[int]:
    """Pids of this user's processes whose environment carries ``NEMO_ORCHESTRA_RUN=token``."""
    needle = f"{RUN_ENV}={token}\0".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == exclude:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:  # gone, or another user's
            continue
        if b"\0" + needle in env or env.endswith(b"\0" + needle[:-1]):
            found.append(int(name))
    return found


def wait_for_exit(pid: int) -> None:
    """Block until process ``pid`` has ended (exited or been killed)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is None:
        while _alive(pid):
            time.sleep(0.2)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def sweep(token: str, folders: list[str], grace_s: float = GRACE_S) -> list[int]:
    """End every process marked ``token`` and remove the run's ``folders``; returns the pids signalled.

    SIGTERM first; SIGKILL to those left after ``grace_s``. multiprocessing's resource trackers go
    last: a tracker ends by itself once every process using it has, unlinking the shared memory
    and semaphores they left; only one still there ``grace_s`` later is killed."""
    me = os.getpid()
    first = marked(token, exclude=me)
    _signal_all([p for p in first if not _is_tracker(p)], signal.SIGTERM)
    for trackers_too in (False, True):
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _left(token, trackers_too):
            time.sleep(0.05)
        for _ in range(20):  # SIGKILL until none is left (a child started meanwhile included)
            left = _left(token, trackers_too)
            if not left:
                break
            _signal_all(left, signal.SIGKILL)
            time.sleep(0.05)
    for folder in folders:
        if os.path.basename(folder).startswith(f"{PREFIX}{token}"):
            shutil.rmtree(folder, ignore_errors=True)
    return first


def _left(token: str, trackers_too: bool) -> list[int]:
    return [p for p in marked(token, exclude=os.getpid()) if _alive(p) and (trackers_too or not _is_tracker(p))]


def _is_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def main(argv: list[str]) -> int:
    pid, token, folders = int(argv[0]), argv[1], argv[2:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ended by the job's end only
    wait_for_exit(pid)
    sweep(token, folders)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
