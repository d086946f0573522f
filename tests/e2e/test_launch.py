"""recipes/launch.py: the main job through NeMo-Run's torchrun launcher (local), and the Slurm job it builds."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nemo_run", reason="recipes/launch.py needs nemo-run (scripts/setup.sh installs it)")

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "warm_start.steps=2",
    "data.num_train_tasks=8",
    "data.num_eval_tasks=4",
    "data.prompts_per_step=1",
    "rollout.group_size=2",
    "rollout.max_turns=1",
    "rollout.max_new_tokens_per_turn=8",
    "rollout.engine=hf",
    "warm_start.num_episodes=8",
    "evaluation.enabled=false",
    "export.enabled=false",
    "trainer.max_steps=1",
]


def _launch(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "launch.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def test_slurm_dryrun_prints_the_sbatch_script(tmp_path):
    r = _launch(
        "executor=slurm",
        "dryrun=true",
        "nodes=2",
        "gpus_per_node=8",
        "account=acct",
        "partition=batch",
        f"job_dir={tmp_path}",
        "workdir=/lustre/nemo-orchestra",
        "recipe=qwen3_8b_2n8g",
        "data.train_path=/lustre/tasks.jsonl",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --account=acct",
        "#SBATCH --partition=batch",
        "source /lustre/nemo-orchestra/.venv/bin/activate",
    ):
        assert line in out, line
    assert "torchrun" in out and "--nnodes 2 --nproc-per-node 8" in out
    scripts = list(tmp_path.glob("experiments/grpo_orchestrator/*/grpo_orchestrator/scripts/*.sh"))
    assert len(scripts) == 1  # what torchrun starts on each process: the main job from the checkout
    body = scripts[0].read_text()
    assert (
        "cd /lustre/nemo-orchestra && exec /lustre/nemo-orchestra/.venv/bin/python recipes/grpo_orchestrator.py "
        "recipe=qwen3_8b_2n8g data.train_path=/lustre/tasks.jsonl"
    ) in body


def test_bad_launcher_and_job_keys_are_one_line_errors(tmp_path):
    r = _launch("executor=kubernetes")
    assert r.returncode == 2 and "executor: must be one of local, slurm, skypilot" in r.stderr
    r = _launch("executor=slurm", "dryrun=true")
    assert r.returncode == 2 and "account:" in r.stderr
    r = _launch("executor=local", "trainer.max_stepz=1")  # the main job's keys are checked before launching
    assert r.returncode == 2 and "trainer.max_stepz" in r.stderr and "Traceback" not in r.stderr
    r = _launch("executor=skypilot", "dryrun=true", f"job_dir={tmp_path}", "recipe=qwen3_8b_1n8g")
    if importlib.util.find_spec("sky") is None:
        assert r.returncode == 2 and "pip install 'nemo-run[skypilot]'" in r.stderr and "Traceback" not in r.stderr
    else:
        assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_local_launch_runs_one_step_under_torchrun(tmp_path):
    out = tmp_path / "run"
    r = _launch("executor=local", "gpus_per_node=1", f"job_dir={tmp_path / 'nemo_run'}", f"run.output_dir={out}", *TINY)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    logs = list((tmp_path / "nemo_run").rglob("*.out")) + list((tmp_path / "nemo_run").rglob("*.log"))
    assert logs, "NeMo-Run kept no log of the job"


@pytest.mark.slow
def test_local_launch_reports_a_failed_job(tmp_path):
    r = _launch("executor=local", f"job_dir={tmp_path / 'nemo_run'}", "data.train_path=/nonexistent/tasks.jsonl", *TINY)
    assert r.returncode == 1 and "the job failed" in r.stderr
