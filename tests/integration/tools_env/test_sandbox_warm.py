"""What is particular to the warm path (runs forked from the zygote): it shows the code the same
sandbox as the cold path, nothing of one run reaches the next, a dead zygote is replaced, the zygote
dies with the process that owns it, and the cold path takes over when no zygote can be set up."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

from sandbox_helpers import FAST, REPO, alive
from tools_env.sandbox import run_python, run_python_sync
from tools_env.sandbox import warm as warm_path
from tools_env.sandbox.probe import _disabled

# Everything about its process that the code can see, except what differs by design from run to run
# (its uid, the run's marker, the cgroup's name).
FINGERPRINT = r"""
import json, os, re, resource, socket, sys
def status(key):
    return next(line.split(":", 1)[1].split() for line in open("/proc/self/status") if line.startswith(key + ":"))
mounts = [line.split()[4] for line in open("/proc/self/mountinfo")]
print(json.dumps({
    "pid": os.getpid(), "ppid": os.getppid(), "root": os.getuid() == 0, "gid_is_uid": os.getgid() == os.getuid(),
    "groups": os.getgroups(), "cwd": os.getcwd(), "umask": os.umask(0o22),
    "env": {k: v for k, v in os.environ.items() if k != "NEMO_SANDBOX_RUN"},
    "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")},
    "status": {k: status(k) for k in ("NoNewPrivs", "Seccomp", "CapEff", "CapPrm", "SigIgn", "SigBlk", "SigCgt")},
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "fds": len(os.listdir("/proc/self/fd")),
    "interfaces": sorted(name for _, name in socket.if_nameindex()),
    "mounts": sorted(mounts), "writable": sorted(m for m in mounts if not os.statvfs(m).f_flag & os.ST_RDONLY),
    "cgroup": re.sub("run-[0-9a-f]+", "run-X", open("/proc/self/cgroup").read()),
    "python": [sys.executable, sys.argv, sys.path, str(sys.flags), sorted(globals())],
    "ctypes_loaded": [m for m in sys.modules if "ctypes" in m],
}, sort_keys=True))
"""


def test_warm_and_cold_show_the_code_the_same_sandbox(workdir):
    seen = {}
    for warm in (True, False):
        r = run_python_sync(FINGERPRINT, workdir, FAST, warm=warm)
        assert r.exit_code == 0, r.stderr
        seen[warm] = json.loads(r.stdout)
    assert seen[True] == seen[False]
    assert seen[True]["ctypes_loaded"] == [] and seen[True]["cwd"] == workdir


LEAVE_TRACES = """
import builtins, json, os, sys
json.dumps = None
builtins.LEFT_BY_EARLIER_RUN = 1
sys.modules["left_by_earlier_run"] = sys
sys.path.append("/left-by-earlier-run")
os.environ["LEFT_BY_EARLIER_RUN"] = "1"
os.environ.pop("HOME")
os.chdir("/")
GLOBAL_LEFT = 1
open(os.path.join(sys.path[0], "left.txt"), "w").write("x")
try:
    open("/dev/shm/left-by-earlier-run", "w").write("x")  # the run's own tmpfs, where it has one
except OSError:
    pass
print("left traces")
"""

LOOK_FOR_TRACES = """
import builtins, json, os, sys
print(sorted(x for x in [
    json.dumps is None and "module attribute", hasattr(builtins, "LEFT_BY_EARLIER_RUN") and "builtin",
    "left_by_earlier_run" in sys.modules and "sys.modules", "/left-by-earlier-run" in sys.path and "sys.path",
    "LEFT_BY_EARLIER_RUN" in os.environ and "environment", "HOME" not in os.environ and "environment",
    os.getcwd() == "/" and "cwd", "GLOBAL_LEFT" in globals() and "global", os.listdir(".") != [] and "file",
    os.path.exists("/dev/shm/left-by-earlier-run") and "/dev/shm",
] if x))
"""


def test_a_run_leaves_nothing_for_the_next(new_workdir, warm):
    """Module attributes, builtins, sys.modules/sys.path, environment, cwd, globals and files of
    one run (in its own workdir, which its episode keeps, and in /dev/shm) are not seen by the next."""
    r = run_python_sync(LEAVE_TRACES, new_workdir(), FAST, warm=warm)
    assert r.stdout == "left traces\n", r.stderr
    r = run_python_sync(LOOK_FOR_TRACES, new_workdir(), FAST, warm=warm)
    assert r.stdout == "[]\n", r.stderr


def current_zygote() -> warm_path._Zygote:
    zygote = warm_path._ZYGOTES.get(_disabled())
    assert zygote is not None and zygote.alive(), "the warm path is set up"
    return zygote


KILL_EVERYTHING = """
import os, signal
for pid in sorted({os.getppid(), *(int(p) for p in os.listdir("/proc") if p.isdigit())} - {os.getpid()}):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
print("still here")
"""


def test_a_run_cannot_kill_the_zygote_and_a_dead_zygote_is_replaced(workdir):
    r = run_python_sync(KILL_EVERYTHING, workdir, FAST)
    assert r.stdout == "still here\n" and r.exit_code == 0, r.stderr
    zygote = current_zygote()  # the run could not see it, let alone signal it
    zygote.proc.send_signal(signal.SIGKILL)  # as if it crashed
    zygote.proc.wait()
    r = run_python_sync("print(6 * 7)", workdir, FAST)
    assert r.stdout == "42\n" and r.exit_code == 0, r.stderr
    assert current_zygote() is not zygote


def test_a_run_in_flight_when_the_zygote_dies_ends_and_the_next_works(workdir):
    run_python_sync("pass", workdir, FAST)
    zygote = current_zygote()

    async def kill_midway():
        task = asyncio.ensure_future(run_python("open('started', 'w')\nimport time\ntime.sleep(30)", workdir, FAST))
        while not os.path.exists(os.path.join(workdir, "started")):
            await asyncio.sleep(0.01)
        zygote.proc.send_signal(signal.SIGKILL)
        return await task

    r = asyncio.run(kill_midway())
    assert r.killed_reason == "signal" and r.exit_code == -signal.SIGKILL
    assert run_python_sync("print(1)", workdir, FAST).stdout == "1\n"


OWNER = """
import sys, tempfile, threading, time
sys.path.insert(0, {repo!r})
from tools_env.sandbox import SandboxLimits, run_python_sync
from tools_env.sandbox.warm import _ZYGOTES
wd = tempfile.mkdtemp()
assert run_python_sync("print(1)", wd).stdout == "1\\n"
zygote = [z for z in _ZYGOTES.values() if z][0].proc.pid
limits = SandboxLimits(wall_time_s=600, cpu_time_s=600)
threading.Thread(target=run_python_sync, args=("import time; time.sleep(600)", wd, limits), daemon=True).start()
{find_children}
print(zygote, *children, flush=True)
time.sleep(600)
"""

FIND_CHILDREN = """
def children_of(pid):  # live ones: an earlier run's pid 1 may wait a moment to be reaped
    import os
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, ppid = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[:2]
            if int(ppid) == pid and state not in "ZX":
                found.append(int(p))
        except OSError:
            pass
    return found
while not (children := children_of(zygote)):
    time.sleep(0.01)
children += [g for c in children for g in children_of(c)]
"""


def test_the_zygote_and_its_runs_end_when_the_owner_is_killed():
    """SIGKILL runs no cleanup in the owner: the zygote sees its socket close (or its parent
    change) and exits; the run in flight dies with it."""
    code = OWNER.format(repo=REPO, find_children=FIND_CHILDREN)
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
    finally:
        owner.kill()
        owner.wait()
    assert len(pids) >= 2, "the zygote and the run's first process"
    deadline = time.monotonic() + 10
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if alive(p)] == [], "outlived the owner by 10 s"


def test_the_cold_path_takes_over_when_no_zygote_can_start(workdir, monkeypatch, caplog):
    monkeypatch.setenv("NEMO_SANDBOX_DISABLE", "nothing-really")  # a plan (and zygote slot) of its own
    monkeypatch.setattr(warm_path, "_ZYGOTE", "import sys; sys.exit(3)")
    with caplog.at_level(logging.WARNING, logger="tools_env.sandbox.warm"):
        r = run_python_sync("print(6 * 7)", workdir, FAST)
        again = run_python_sync("print(7 * 8)", workdir, FAST)
    assert (r.stdout, again.stdout) == ("42\n", "56\n")
    assert warm_path._ZYGOTES["nothing-really"] is None
    warnings = [m for m in caplog.messages if re.search("warm path unavailable.*cold path", m)]
    assert len(warnings) == 1, caplog.messages
