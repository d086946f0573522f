"""`recipes/benchmark.py grpo` on a tiny run: a JSON report whose phases account for the step."""

import json
import os
import subprocess
import sys

import pytest

from nemo_orchestra.data.default_tasks import MULTISTEP_TURNS
from tools_env.supervisor import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "recipes", "benchmark.py")
TINY = [
    "warm_start.num_episodes=32",
    "data.num_train_tasks=16",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_turns=2",
    "rollout.max_new_tokens_per_turn=16",
    "rollout.engine=hf",
]


def bench(tmp_path, steps: int, *overrides: str, env=None):
    """``benchmark.py grpo`` on the tiny run: (its stdout, its JSON report). Its run folder is
    ``tmp_path/run`` unless the overrides name one (or the environment is given: the default, a
    temp folder)."""
    out = tmp_path / "grpo.json"
    args = ["--steps", str(steps), "--warmup", "0", "--out", str(out)]
    if env is None and not any(o.startswith("run.output_dir=") for o in overrides):
        args.append(f"run.output_dir={tmp_path / 'run'}")
    p = subprocess.run(
        [sys.executable, SCRIPT, "grpo", *args, *TINY, *overrides], capture_output=True, text=True, timeout=600, env=env
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout, json.loads(out.read_text())


def test_grpo_benchmark_reports_every_phase(tmp_path):
    temp = tmp_path / "temp"  # the run's folder is a temp folder, spent once the report is written elsewhere
    temp.mkdir()
    stdout, report = bench(tmp_path, 2, env={**os.environ, "TMPDIR": str(temp)})
    assert not [e.name for e in temp.iterdir() if e.name.startswith("bench_grpo-")]
    s = report["per_step"]
    phases = ("rollout_wait_s", "reference_logprobs_s", "training_s", "weight_sync_s")  # the step's critical path
    assert all(s[k] > 0 for k in phases + ("generation_s", "environment_s")), s
    assert sum(s[k] for k in phases) <= s["step_s"] * 1.001 and s["other_s"] >= -1e-3 * s["step_s"]
    # synchronous: the trainer waits for the whole rollout, generation and environment
    assert s["generation_s"] + s["environment_s"] <= s["rollout_wait_s"] * 1.001
    assert 0 < s["rollout_wait_share"] < 1 and 0 < s["mfu"] < 1  # against the matmul peak measured in the run
    assert s["peak_tflops"] > 0.001 and s["tflops_per_gpu"] == pytest.approx(s["mfu"] * s["peak_tflops"])
    assert 0 < s["step_mfu"] < s["mfu"]
    # an untrained policy writes whole turns: 4 trajectories x 16 tokens x 2 turns, or a multi-step task's own 4
    assert 0 < s["generated_tokens_per_step"] <= 4 * MULTISTEP_TURNS * 16
    assert s["tokens_per_s"] > 0 and report["measured_steps"] == 2 and len(report["steps"]) == 2
    assert "generation" in stdout and "weight_sync" in stdout and "MFU" in stdout


def test_grpo_benchmark_rejects_a_bad_override(tmp_path):
    """Exit 2 naming the key, and no output folder left behind (the run's default one is a temp dir)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    p = subprocess.run(
        [sys.executable, SCRIPT, "grpo", "rollout.group_size=one"], capture_output=True, text=True, timeout=120, env=env
    )
    assert p.returncode == 2 and "rollout.group_size" in p.stdout + p.stderr
    assert list(tmp_path.iterdir()) == []


def test_grpo_benchmark_runs_rollouts_ahead_with_max_staleness(tmp_path):
    stdout, report = bench(tmp_path, 3, "rollout.steps_ahead=1", "loss.tis_cap=2.0", "perf.overlap_reference=true")
    assert report["config"]["steps_ahead"] == 1
    steps = report["steps"]
    assert max(m["rollout/staleness_max"] for m in steps) == 1  # later steps' rollouts ran during training
    assert all(m["rollout/stale_dropped"] == 0 for m in steps)
    # the reference pass ran on its own thread, off the step's critical path
    s = report["per_step"]
    assert s["reference_logprobs_s"] == 0 and s["reference_ahead_s"] > 0
    # the update's waits for it are part of its time
    assert all(0 <= m["time/ref_logprobs_wait_s"] <= m["time/update_s"] for m in steps)
    assert s["reference_wait_s"] == sum(m["time/ref_logprobs_wait_s"] for m in steps) / len(steps)
    assert s["other_s"] >= -1e-3 * s["step_s"] and "reference logprobs beside the update" in stdout
    # at idle priority exactly in the steps whose trainer waited for its rollouts
    from nemo_orchestra.train.trainer import ENGINE_BEHIND_S

    assert [m["perf/ref_logprobs_idle"] for m in steps] == [
        float(m["time/rollout_wait_s"] > ENGINE_BEHIND_S) for m in steps
    ]
    assert s["reference_idle_share"] == sum(m["perf/ref_logprobs_idle"] for m in steps) / len(steps)
