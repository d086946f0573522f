"""A recipe given a bad key or input exits non-zero with one line naming it, no traceback (the recipe
as a process)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_recipe_exits_nonzero_naming_the_key():
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes/grpo_orchestrator.py"), "no_such.key=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "no_such.key" in r.stderr


@pytest.mark.parametrize(
    "override,message",
    [
        ("tools.url=http://127.0.0.1:9", "tools.url: no tool service answers"),
        ("data.train_path=/nonexistent/train.jsonl", "/nonexistent/train.jsonl"),
    ],
)
def test_recipe_reports_bad_inputs_without_a_traceback(override, message, tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes/grpo_orchestrator.py"), override, f"run.output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
