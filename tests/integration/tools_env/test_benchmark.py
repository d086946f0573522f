"""The benchmark dispatcher and a tiny run of the tools_env benchmark."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import tools_env as bench
from tools_env.supervisor import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "recipes", "benchmark.py")


def test_unknown_subcommand_lists_the_valid_ones():
    p = subprocess.run([sys.executable, SCRIPT, "nonsense"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown benchmark 'nonsense'" in p.stderr and "tools_env" in p.stderr


def test_tiny_tools_env_run_writes_a_report(tmp_path):
    out = tmp_path / "bench.json"
    report = bench.run(
        str(out), workers=(1,), seconds=0.3, concurrency=(1, 8), paced_rate=200, tools=("calculator",), warmup_s=0.1
    )
    saved = json.loads(out.read_text())
    assert saved["results"] == report["results"]
    modes = [(r["mode"], r["episodes"]) for r in saved["results"]]
    assert modes == [("saturate", 1), ("saturate", 8), ("paced", 8), ("client", 8)]
    assert all(r["calls"] > 0 and r["errors"] == 0 and r["p99_ms"] >= r["p50_ms"] for r in saved["results"])


def test_tiny_python_run_measures_each_sandbox_path(tmp_path):
    report = bench.run(
        None,
        workers=(1,),
        seconds=1.0,
        concurrency=(1,),
        tools=("python",),
        warmup_s=0.0,  # a call counts when it starts inside the window, so with no warm-up the first always does
        python_paths=("warm", "cold"),
    )
    rows = [(r["tool"], r["sandbox"], r["episodes"]) for r in report["results"]]
    assert rows == [("python", "warm", 1), ("python", "cold", 1)]
    assert all(r["calls"] > 0 and r["errors"] == 0 for r in report["results"]), report["results"]


def test_unknown_sandbox_path_is_a_value_error():
    with pytest.raises(ValueError, match="unknown sandbox path 'lukewarm'; valid: warm, cold"):
        bench.run(None, tools=("python",), python_paths=("lukewarm",))
