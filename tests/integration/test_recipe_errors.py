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


def test_a_resume_with_another_model_stops_before_writing_anything(tmp_path):
    """One line naming the keys, exit 2, and the run's config.yaml as it was."""
    from dataclasses import replace

    from nemo_orchestra.config import load_config
    from tests.unit.test_run_control import _checkpoint_of

    cfg = load_config([])
    _checkpoint_of(tmp_path, replace(cfg.model, num_layers=cfg.model.num_layers + 1))
    (tmp_path / "config.yaml").write_text("# the run's own\n")
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes/grpo_orchestrator.py"), f"run.output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert f"model.num_layers={cfg.model.num_layers} (checkpoint: {cfg.model.num_layers + 1})" in r.stderr
    assert (tmp_path / "config.yaml").read_text() == "# the run's own\n"
