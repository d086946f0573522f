"""A run that fails while it is being built (after its tool service and client are up) stops with one
error line: the client's connections are closed, so no "Unclosed client session" report follows it. A
user's tokenizer and its chat template are checked before any episode runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *options: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS",)}
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes/grpo_orchestrator.py"),
            "rollout.engine=hf",
            "warm_start.num_episodes=32",
            "data.num_train_tasks=16",
            f"run.output_dir={tmp_path / 'run'}",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-4000:]
    assert "Unclosed" not in out and "Traceback" not in out, out[-4000:]
    return out


@pytest.mark.slow
def test_failure_after_the_service_started_says_why_in_one_line(tmp_path):
    """A chat template file that fails the probe is known once the embedded tokenizer is built, after the
    warm-start episodes."""
    template = ROOT / "tests/fixtures/chat_templates/qwen2.5-instruct.jinja"
    out = _run(tmp_path, f"model.chat_template={template}")
    assert "scripted warm-start episodes" in out  # it failed after the service had answered
    assert "cannot keep what is trained equal to what a server renders" in out


@pytest.mark.slow
def test_a_users_tokenizer_is_checked_before_any_episode(tmp_path):
    out = _run(tmp_path, f"model.tokenizer={tmp_path / 'no-such-tokenizer'}")
    assert "model.tokenizer: no tokenizer folder at" in out
    assert "scripted warm-start episodes" not in out  # no episode ran, no endpoint was called
