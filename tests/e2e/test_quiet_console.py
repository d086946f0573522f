"""A short default run (vLLM rollouts, warm start, held-out evaluation, export): its console has no
Python warning, traceback or third-party WARNING line, one summary line per step, one progress bar
per phase; its TensorBoard event files hold the same scalars as metrics.jsonl."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "warm_start.steps=3",
    "warm_start.num_episodes=96",
    "data.num_train_tasks=16",
    "data.num_eval_tasks=4",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_turns=2",
    "trainer.max_steps=2",
]
NOISE = re.compile(r"Warning|WARNING|Traceback|warnings\.warn")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("quiet")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "PYTHONWARNINGS", "VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL")
    }
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes/grpo_orchestrator.py"), *SHORT, f"run.output_dir={out}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return out, (r.stdout + r.stderr).replace("\r", "\n").splitlines()


@pytest.mark.slow
def test_console_has_no_warning_or_traceback(run):
    _, lines = run
    noisy = [line for line in lines if NOISE.search(line)]
    assert not noisy, "\n".join(noisy[:20])


@pytest.mark.slow
def test_one_summary_line_per_step_and_one_bar_per_phase(run):
    _, lines = run
    summaries = [line for line in lines if re.search(r"nemo_orchestra: step \d+ ", line)]
    assert [re.search(r"step (\d+) ", s).group(1) for s in summaries] == ["1", "2"]
    assert all("reward=" in s and "acc=" in s for s in summaries)
    bars = {m.group(1) for line in lines if (m := re.match(r"^([\w ]+): +\d+%", line))}
    assert bars == {"warm start", "grpo"}  # no engine's loading bar either


@pytest.mark.slow
def test_tensorboard_holds_the_metrics_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    numeric = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
    assert "reward/mean" in numeric and "data/task_ids" in rows[0]
    assert set(acc.Tags()["scalars"]) == numeric  # every number, and not the list of task ids
    for key in sorted(numeric):  # a step with no trainable group has no loss/*: those keys skip it
        logged = [(e.step, e.value) for e in acc.Scalars(key)]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6, abs=1e-12)) for r in rows if key in r], key
