"""Where the sandbox's caller is not root, and where the checkout is not readable by others.

A driver process runs the key attacks as `nobody` (with user namespaces, and with the audit hook
alone), on both paths. The driver imports the package from a copy that `nobody` can read, so the
tests do not depend on where the checkout lives (a 0700 home folder, say). The last test runs the
sandbox as root from a copy of the package under a 0700 folder: the sandboxed code, which runs as
a fresh uid, must not need to read it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid

import pytest

from sandbox_helpers import copy_package, live_pids_holding, run_as_nobody

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become an unprivileged user")

# Each attack prints one line that the test checks; a driver runs it as `nobody`. PORT is a
# listener of the test's own, TOKEN a fresh file name, SECRET a value in the driver's environment.
CONNECT = "import socket; s = socket.socket(); s.settimeout(1); s.connect(('127.0.0.1', PORT))"
NOT_ROOT_ATTACKS = {
    "network": (f"try:\n    {CONNECT}\n    print('connected')\nexcept OSError:\n    print('refused')", "refused"),
    "network-child": (
        "import subprocess, sys\ntry:\n    subprocess.run([sys.executable, '-c', CONNECT], check=True)\n"
        "    print('connected')\nexcept (OSError, subprocess.CalledProcessError):\n    print('refused')",
        "refused",
    ),
    "write-tmp": (
        "try:\n    open('/tmp/TOKEN', 'w')\n    print('wrote')\nexcept OSError:\n    print('refused')",
        "refused",
    ),
    "service-env": (
        "import os\ntry:\n    print('SECRET' in open(f'/proc/{os.getppid()}/environ').read())\n"
        "except OSError:\n    print(False)",
        "False",
    ),
    "escaped-child": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    f = open('TOKEN', 'w')\n"
        "    time.sleep(1000)\ntime.sleep(0.3)\nprint('forked')",
        "forked",
    ),
}

DRIVER = """
import json, shutil, sys, tempfile
sys.path.insert(0, {package_root!r})
from tools_env.sandbox import SandboxLimits, run_python_sync, sandbox_capabilities
from tools_env.sandbox.warm import _ZYGOTES
wd = tempfile.mkdtemp()
r = run_python_sync({code!r}, wd, SandboxLimits(wall_time_s=5, cpu_time_s=2), warm={warm!r})
shutil.rmtree(wd)
print(json.dumps({{"stdout": r.stdout, "stderr": r.stderr, "caps": sandbox_capabilities(),
                  "zygotes": sum(z is not None for z in _ZYGOTES.values())}}))
"""


@pytest.mark.parametrize("mode", ["userns", "hook-only"])
@pytest.mark.parametrize("attack", list(NOT_ROOT_ATTACKS))
def test_not_root(readable_package, warm, mode, attack):
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    token = uuid.uuid4().hex
    code, expected = NOT_ROOT_ATTACKS[attack]
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = str(listener.getsockname()[1])
    code = code.replace("CONNECT", repr(CONNECT)).replace("PORT", port).replace("TOKEN", token).replace("SECRET", token)
    env = {"PATH": "/usr/bin:/bin", "SECRET": token, "NEMO_SANDBOX_DISABLE": "userns" if mode == "hook-only" else ""}
    driver = DRIVER.format(package_root=readable_package, code=code, warm=warm)
    try:
        out = run_as_nobody(python, driver, env, timeout=60)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.splitlines()[-1])
    assert r["caps"]["root"] is False and r["caps"]["audit_strict"] is (mode == "hook-only")
    assert r["zygotes"] == (1 if warm else 0), "the warm path was set up (and only when asked for)"
    assert r["stdout"] == expected + "\n", r["stderr"]
    assert not os.path.exists(f"/tmp/{token}")
    assert live_pids_holding(token) == [], "nothing of the run is left"


PRIVATE_CODE = """
import os
try:
    os.listdir(PRIVATE)
    print("read the checkout")
except (PermissionError, FileNotFoundError):  # the uid may not read it; with fs_allowlist it is not there
    print("cannot read the checkout")
print(os.getuid() != 0, sum(range(10)))
"""


def test_runs_from_a_package_under_a_private_folder(tmp_path, caps, warm):
    """The service runs from a checkout under a 0700 folder (like /root): the sandboxed code runs
    as a fresh uid that cannot read the checkout, and needs nothing from it."""
    if not caps["uid_drop"]:
        pytest.skip("no uid drop on this host")
    private = tmp_path / "home"
    private.mkdir(mode=0o700)
    root = copy_package(str(private))
    code = PRIVATE_CODE.replace("PRIVATE", repr(str(private)))
    driver = DRIVER.format(package_root=root, code=code, warm=warm)
    out = subprocess.run(
        [sys.executable, "-I", "-c", driver],
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.splitlines()[-1])
    assert r["stdout"] == "cannot read the checkout\nTrue 45\n", r["stderr"]
    assert r["zygotes"] == (1 if warm else 0)
