"""A run that fails while it is being built (after its tool service and client are up) stops with one
error line: the client's connections are closed, so no "Unclosed client session" report follows it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_failure_after_the_service_started_says_why_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS",)}
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes/grpo_orchestrator.py"),
            "rollout.engine=hf",
            "sft.num_episodes=32",
            "data.num_train_tasks=16",
            f"model.tokenizer={tmp_path / 'no-such-tokenizer'}",
            f"run.output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-4000:]
    assert "model.tokenizer: no tokenizer folder at" in out
    assert "scripted warm-start episodes" in out  # it failed after the service had answered
    assert "Unclosed" not in out and "Traceback" not in out, out[-4000:]
