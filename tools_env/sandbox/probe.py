"""Probe the host once (per NEMO_SANDBOX_DISABLE value) for the layers a run can enter."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import uuid

from tools_env.sandbox.allowlist import host_allowlist
from tools_env.sandbox.cgroup import _cgroup_base
from tools_env.sandbox.cleanup import _kill_strays
from tools_env.sandbox.limits import SandboxLimits
from tools_env.sandbox.output import _read_status
from tools_env.sandbox.plan import _Plan, _strict
from tools_env.sandbox.prepare import (
    _ancestors,
    _launch_spec,
    _launcher_argv,
    _next_uid,
    _nproc_limit,
    _sandbox_env,
    _take_ownership,
)

logger = logging.getLogger(__name__)

_PLANS: dict[str, _Plan] = {}
_PLAN_LOCK = threading.Lock()


def sandbox_capabilities() -> dict[str, bool]:
    """Which isolation layers a run gets on this host (see the package docstring); probed once."""
    plan = _get_plan()
    ly = plan.layers
    return {
        "root": plan.root,
        "uid_drop": ly["uid_drop"],
        "user_namespace": ly["userns"],
        "network_namespace": ly["netns"],
        "mount_namespace": ly["mountns"],
        "fs_allowlist": ly["allowlist"],
        "pid_namespace": ly["pidns"],
        "private_proc": ly["proc"],
        "no_new_privs": ly["nnp"],
        "cgroup": plan.cgroup_base is not None,
        "rlimits": True,
        "nproc_per_run": ly["uid_drop"] or ly["userns"],
        "audit_hook": plan.python_ok,
        "audit_strict": _strict(plan, network=False),
        "python_ok": plan.python_ok,
    }


def _disabled() -> str:
    return os.environ.get("NEMO_SANDBOX_DISABLE", "")


def _get_plan() -> _Plan:
    key = _disabled()
    with _PLAN_LOCK:
        if key not in _PLANS:
            _PLANS[key] = _probe(set(filter(None, key.split(","))))
            missing = [k for k, v in _key_layers(_PLANS[key]).items() if not v]
            if missing:
                logger.warning("code sandbox runs without: %s (see tools_env/sandbox/__init__.py)", ", ".join(missing))
        return _PLANS[key]


def _key_layers(plan: _Plan) -> dict[str, bool]:
    return {
        "uid_drop or user_namespace": plan.layers["uid_drop"] or plan.layers["userns"],
        "network_namespace": plan.layers["netns"],
        "mount_namespace": plan.layers["mountns"],
        "fs_allowlist (host files hidden)": plan.layers["allowlist"],
        "pid_namespace": plan.layers["pidns"],
        "private_proc": plan.layers["proc"],
        "cgroup": plan.cgroup_base is not None,
        "python": plan.python_ok,
    }


def _probe(disabled: set[str]) -> _Plan:
    """Run the launcher once in probe mode: it tries every layer, reports which it entered, then
    execs the bootstrap, which reports that the interpreter and the audit hook work."""
    root = os.geteuid() == 0
    want = {
        "uid_drop": root and "uid" not in disabled,
        "userns": not root and "userns" not in disabled,
        "netns": "netns" not in disabled,
        "pidns": "pidns" not in disabled,
        "mountns": "mountns" not in disabled,
        "nnp": True,
    }
    want["proc"] = want["mountns"]
    python = _sandbox_python(want["uid_drop"])
    want["allowlist"], allow = want["mountns"] and "allowlist" not in disabled, None
    if want["allowlist"]:
        try:
            allow = host_allowlist(python)
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
            logger.warning("code sandbox: no file-system allowlist for %s: %s", python, e)
            want["allowlist"] = False
    plan = _Plan(root, python, want, False, None, allow)
    wd = tempfile.mkdtemp(prefix="nemo-sandbox-probe-", dir="/tmp" if os.path.isdir("/tmp") else None)
    uid = _next_uid() if want["uid_drop"] else None
    marker = uuid.uuid4().hex
    try:
        spec = _launch_spec(plan, wd, uid, SandboxLimits(), _nproc_limit(plan, uid, 16), None, probe=True)
        _take_ownership(wd, uid)
        r, w = os.pipe()
        spec["status_fd"] = w
        try:
            subprocess.run(
                _launcher_argv(spec),
                input=b"",
                capture_output=True,
                pass_fds=(w,),
                timeout=60,
                start_new_session=True,
                env=_sandbox_env(wd, marker),
                cwd=wd,
            )
        except subprocess.TimeoutExpired:
            pass
        finally:
            os.close(w)
        status = _read_status(r)
    finally:
        _kill_strays(uid, marker)
        shutil.rmtree(wd, ignore_errors=True)
    entered = next((json.loads(line[7:]) for line in status if line.startswith("layers ")), {})
    layers = {k: bool(want[k] and entered.get(k)) for k in want}
    cgroup = None if "cgroup" in disabled else _cgroup_base()
    return _Plan(root, python, layers, "probe-ok" in status, cgroup, allow)


def _sandbox_python(drop_uid: bool) -> str:
    if os.environ.get("NEMO_SANDBOX_PYTHON"):
        return os.environ["NEMO_SANDBOX_PYTHON"]
    candidates = [sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"]
    for exe in candidates:
        if exe and os.path.exists(exe) and (not drop_uid or _world_executable(exe)):
            return exe
    return sys.executable  # the probe will report python_ok=False


def _world_executable(path: str) -> bool:
    """Can a uid that is neither owner nor group run `path`?"""
    path = os.path.realpath(path)
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in [*_ancestors(path), path])
