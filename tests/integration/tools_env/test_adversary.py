"""The adversary's attacks (tools_env/adversary.py) from inside the `python` tool, with the
file-system allowlist on (every attack fails: the paths are not there) and off through the test
switch NEMO_SANDBOX_DISABLE=allowlist (the reads the other layers do not stop succeed, so these
tests can fail). Through the service as root, and through run_python as `nobody` (not root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import pytest

from sandbox_helpers import run_as_nobody
from tools_env.adversary import ATTACKS, _WRAP, plant, reached, run_attacks
from tools_env.supervisor import start_service

HIDDEN = {"hidden FileNotFoundError", "hidden nothing"}  # what the allowlist's root answers
# Stopped without the allowlist too, as root: by the uid drop (0700 folders) or the mount namespace.
OTHER_LAYERS = {"list the home folders", "read the service config", "find another episode's files"}


@pytest.fixture
def planted():
    folder = tempfile.mkdtemp(prefix="nemo-adversary-test-")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _attack_service(folder, monkeypatch, disable):
    monkeypatch.setenv("NEMO_SANDBOX_DISABLE", disable)  # the service inherits it
    with start_service({}) as svc:
        p = plant(folder, os.path.join(svc.tmpdir, "config.json"))
        return p, run_attacks(svc.urls[0], p, svc.token)


@pytest.mark.skipif(os.geteuid() != 0, reason="the service as root; not root is below")
def test_no_attack_reaches_anything_through_the_service(planted, monkeypatch, caps):
    if not caps["fs_allowlist"]:
        pytest.skip("no fs_allowlist on this host")
    p, out = _attack_service(planted, monkeypatch, "")
    assert set(out) == set(ATTACKS)
    for name, obs in out.items():
        assert obs.strip() in HIDDEN, (name, obs)
        assert p.secret not in obs


@pytest.mark.skipif(os.geteuid() != 0, reason="the service as root; not root is below")
def test_the_attacks_succeed_with_the_allowlist_off(planted, monkeypatch):
    p, out = _attack_service(planted, monkeypatch, "allowlist")
    for name, obs in out.items():
        assert reached(obs) is (name not in OTHER_LAYERS), (name, obs)
    assert p.secret in out["read the task file"] and p.secret in out["read the held-out tasks"]
    assert out["list the home folders"].strip() == "hidden PermissionError"  # the uid drop's reason


def test_a_service_that_requires_the_allowlist_refuses_to_start_without_it(monkeypatch, caps):
    if caps["fs_allowlist"]:
        with start_service({"python": {"require_fs_allowlist": True}}) as svc:
            assert svc.urls
    monkeypatch.setenv("NEMO_SANDBOX_DISABLE", "allowlist")
    with pytest.raises(Exception, match="require_fs_allowlist is true"):
        with start_service({"python": {"require_fs_allowlist": True}}):
            pass


DRIVER = """
import json, shutil, sys, tempfile
sys.path.insert(0, {package_root!r})
from tools_env.sandbox import SandboxLimits, run_python_sync, sandbox_capabilities
out = {{}}
for name, code in {codes!r}.items():
    wd = tempfile.mkdtemp()
    out[name] = run_python_sync(code, wd, SandboxLimits(wall_time_s=10, cpu_time_s=5)).stdout
    shutil.rmtree(wd)
print(json.dumps({{"out": out, "caps": sandbox_capabilities()}}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become an unprivileged user")
@pytest.mark.parametrize("allowlist", [True, False], ids=["allowlist", "allowlist-off"])
def test_not_root(planted, readable_package, allowlist):  # noqa: F811
    """As `nobody`, with user namespaces: the same attacks on files `nobody` may read."""
    p = plant(planted)
    fill = {"task": p.task, "run": p.run, "top": p.top, "repo": readable_package, "config": "/nonexistent"}
    names = [
        "read the task file",
        "list the run folder",
        "glob for jsonl files",
        "read the held-out tasks",
        "read /etc/passwd",
        "list the checkout",
    ]
    codes = {}
    for name in names:
        body = "\n".join("    " + line for line in ATTACKS[name].format(**fill).splitlines())
        codes[name] = _WRAP.format(body=body)
    env = {"PATH": "/usr/bin:/bin", "NEMO_SANDBOX_DISABLE": "" if allowlist else "allowlist"}
    python = shutil.which("python3", path="/usr/bin:/bin")
    run = run_as_nobody(python, DRIVER.format(package_root=readable_package, codes=codes), env, timeout=120)
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout.splitlines()[-1])
    if not r["caps"]["user_namespace"]:
        pytest.skip("no unprivileged user namespaces here")
    assert r["caps"]["fs_allowlist"] is allowlist
    for name, obs in r["out"].items():
        if allowlist:
            assert obs.strip() in HIDDEN, (name, obs)
        else:
            assert reached(obs), (name, obs)


USEFUL = """
import json, sqlite3, decimal, email.parser, pathlib, site, sys
packages = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
pathlib.Path("out.txt").write_text(json.dumps(sorted(sys.modules)[:1]))
print(pathlib.Path("out.txt").exists(), bool(packages), sqlite3.connect("db.sqlite").execute("select 1").fetchone())
"""


def test_the_code_still_imports_the_stdlib_and_packages_and_writes_its_workdir(workdir, warm, caps):
    from tools_env.sandbox import SandboxLimits, run_python_sync

    if not caps["fs_allowlist"]:
        pytest.skip("no fs_allowlist on this host")
    r = run_python_sync(USEFUL, workdir, SandboxLimits(wall_time_s=10), warm=warm)
    assert r.stdout == "True True (1,)\n", r.stderr
    assert os.path.exists(os.path.join(workdir, "out.txt"))
    pkg = next(p for p in ("yaml", "six", "pip", "setuptools") if _importable_by_sandbox_python(p))
    r = run_python_sync(f"import {pkg}; print({pkg}.__name__)", workdir, SandboxLimits(wall_time_s=10), warm=warm)
    assert r.stdout == f"{pkg}\n", r.stderr


def _importable_by_sandbox_python(name: str) -> bool:
    from tools_env.sandbox.probe import _get_plan

    probe = subprocess.run([_get_plan().python, "-I", "-c", f"import {name}"], capture_output=True)
    return probe.returncode == 0
