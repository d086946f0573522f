"""A run's network namespace holds nothing of any other run's. Where the zygote lends namespaces
from its pool (root: runs born in a pid namespace, not in a user namespace), a namespace is lent to
one run at a time and again only once every process of its last run has exited: two runs in flight
cannot reach each other, and a run lent its predecessor's namespace finds no socket, port or name
that one left, even ones held in flight by a cycle of unix sockets or by a process that outlived the
code. The checks first show they see such traces where they are. The code runs in a child
interpreter, which has no audit hook: only the kernel's namespaces stand in its way."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
from sandbox_helpers import FAST
from tools_env.sandbox import run_python, run_python_sync

# Sockets, a port and names that outlive the code if anything does: a listener kept open by a
# process of its own, and, in flight in a unix socket's queue that only that queue refers to, a
# bound datagram socket and a bound UDP port.
LEAVE = r"""
import os, socket, time
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind("\0trace-listen")
listener.listen()
held = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
held.bind("\0trace-cycle")
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("0.0.0.0", 45454))
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
socket.send_fds(b, [b"x"], [a.fileno(), held.fileno(), udp.fileno()])
if os.fork() == 0:
    os.setsid()
    time.sleep(60)
    os._exit(0)
"""

LOOK = r"""
import json, os, socket
found = []
for table in ("unix", "tcp", "tcp6", "udp", "udp6", "raw", "raw6", "packet"):
    try:
        found += [f"{table}: {line}" for line in open(f"/proc/net/{table}").read().splitlines()[1:]]
    except OSError:
        pass
def outcome(act):
    try:
        act()
        return "ok"
    except OSError as e:
        return type(e).__name__
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
bound = []
def bind(family, kind, address):
    s = socket.socket(family, kind)
    bound.append(s)
    s.bind(address)
print(json.dumps({
    "ns": os.readlink("/proc/self/ns/net"),
    "found": found,
    "connect": outcome(lambda: c.connect("\0trace-listen")),
    "bind_name": outcome(lambda: bind(socket.AF_UNIX, socket.SOCK_DGRAM, "\0trace-cycle")),
    "bind_port": outcome(lambda: bind(socket.AF_INET, socket.SOCK_DGRAM, ("0.0.0.0", 45454))),
}))
"""

NOTHING = {"found": [], "connect": "ConnectionRefusedError", "bind_name": "ok", "bind_port": "ok"}


def unhooked(code: str) -> str:
    """`code` run by a child interpreter, whose exit and output are the run's."""
    return f"import subprocess, sys\nsys.exit(subprocess.run([sys.executable, '-c', {code!r}]).returncode)"


def looked(r) -> dict:
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def pooled(caps) -> bool:
    return caps["root"] and caps["network_namespace"] and caps["pid_namespace"] and not caps["user_namespace"]


@pytest.fixture(autouse=True)
def children_allowed(caps):
    if not caps["network_namespace"] or caps["audit_strict"]:
        pytest.skip("no network namespace here, or no child programs")


def test_the_check_sees_what_a_run_leaves_while_it_is_there(workdir, caps):
    seen = looked(run_python_sync(unhooked(LEAVE + LOOK), workdir, FAST))
    assert seen["connect"] == "ok" and seen["bind_name"] == seen["bind_port"] == "OSError"
    assert any("@trace-listen" in line for line in seen["found"]), seen["found"]
    assert any("@trace-cycle" in line for line in seen["found"]), seen["found"]
    assert any(line.startswith("udp: ") for line in seen["found"]), seen["found"]


def test_a_run_lent_the_namespace_of_the_run_before_finds_nothing_of_it(new_workdir, caps, warm):
    left = run_python_sync(unhooked(LEAVE + "print(os.readlink('/proc/self/ns/net'))"), new_workdir(), FAST, warm=warm)
    assert left.exit_code == 0, left.stderr
    ns = left.stdout.strip()
    lent_again = warm and pooled(caps)
    for _ in range(20 if lent_again else 1):  # the pool lends the oldest one returned: this one comes round
        seen = looked(run_python_sync(unhooked(LOOK), new_workdir(), FAST, warm=warm))
        assert {k: seen[k] for k in NOTHING} == NOTHING, seen
        if seen["ns"] == ns:
            break
        time.sleep(0.1)
    if lent_again:
        assert seen["ns"] == ns, "the zygote lends its namespaces again"


LISTEN = r"""
import os, socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\0peer")
s.listen()
s.settimeout(3)
open("listening", "w").close()
try:
    s.accept()
    print("reached", os.readlink("/proc/self/ns/net"))
except TimeoutError:
    print("alone", os.readlink("/proc/self/ns/net"))
"""

CONNECT = r"""
import os, socket, time
end = time.monotonic() + 1.5
while True:
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect("\0peer")
        print("reached", os.readlink("/proc/self/ns/net"))
        break
    except OSError:
        if time.monotonic() > end:
            print("alone", os.readlink("/proc/self/ns/net"))
            break
        time.sleep(0.05)
"""


async def two_at_once(listen_dir: str, connect_dir: str) -> tuple[list[str], list[str]]:
    listener = asyncio.ensure_future(run_python(unhooked(LISTEN), listen_dir, FAST))
    while not os.path.exists(os.path.join(listen_dir, "listening")):
        assert not listener.done(), (await listener).stderr
        await asyncio.sleep(0.01)
    connected = await run_python(unhooked(CONNECT), connect_dir, FAST)
    listened = await listener
    assert listened.exit_code == connected.exit_code == 0, (listened.stderr, connected.stderr)
    return listened.stdout.split(), connected.stdout.split()


def test_two_runs_in_flight_cannot_reach_each_other(new_workdir, caps):
    listened, connected = asyncio.run(two_at_once(new_workdir(), new_workdir()))
    assert listened[0] == connected[0] == "alone"
    assert listened[1] != connected[1], "two runs at once never share a namespace"


def test_two_programs_in_one_namespace_reach_each_other(tmp_path):
    """The same two programs outside the sandbox, in this process's namespace: the check sees them meet."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    listener = subprocess.Popen(
        [sys.executable, "-c", LISTEN], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "listening").exists():
            assert listener.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        connected = subprocess.run([sys.executable, "-c", CONNECT], env=env, capture_output=True, text=True, timeout=10)
        listened = listener.communicate(timeout=10)[0]
    finally:
        listener.kill()
        listener.wait()
    assert listened.split()[0] == connected.stdout.split()[0] == "reached"
