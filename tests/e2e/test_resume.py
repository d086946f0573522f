"""A run killed with SIGKILL mid-training resumes from its last checkpoint and sees the same data.

The data order of an uninterrupted run is ``Trainer.batch_tasks(step)``; every step logs the task
ids it used (``data/task_ids``). The killed run's steps and the resumed run's steps must both
follow that order, and the resumed run must start right after the newest complete checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 6
ARGS = [f"trainer.max_steps={MAX_STEPS}", "checkpoint.save_every=1", "checkpoint.keep=2", "sft.steps=2",
        "sft.num_episodes=32", "data.num_train_tasks=48", "data.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_turns=1", "rollout.max_new_tokens_per_turn=16", "evaluation.enabled=false",
        "export.enabled=false", "rollout.engine=hf"]


def _cmd(out):
    return [sys.executable, str(ROOT / "recipes/grpo_orchestrator.py"), *ARGS, f"run.output_dir={out}"]


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")} | {
        "PYTHONWARNINGS": "ignore"}


def _latest_step(out: Path) -> int:
    latest = out / "checkpoints" / "latest"
    return int(latest.read_text().strip().split("_")[1]) if latest.is_file() else 0


def _expected_order(steps: int) -> list[list[str]]:
    """What an uninterrupted run feeds each step (the trainer's own function)."""
    from nemo_orchestra.config import load_config
    from nemo_orchestra.data.default_tasks import generate_tasks
    from nemo_orchestra.train.trainer import Trainer

    cfg = load_config(ARGS)
    fake = SimpleNamespace(cfg=cfg, tasks=generate_tasks(cfg.data.num_train_tasks, cfg.run.seed), dp_rank=0, dp_size=1)
    return [[t.id for t in Trainer.batch_tasks(fake, s)] for s in range(steps)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_then_resume_keeps_the_data_order(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 600
    while _latest_step(out) < 2:  # kill once two checkpoints exist: the run is in its third step
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.2)
    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)  # tool service, checkpoint writer, trackers
    assert children
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running after the trainer's SIGKILL: {[' '.join(p.cmdline())[:120] for p in alive]}"
    killed_at = _latest_step(out)
    assert killed_at < MAX_STEPS

    r = subprocess.run(_cmd(out), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"at step {killed_at}" in r.stderr  # "resumed from .../step_0000000N at step N"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert steps[-(MAX_STEPS - killed_at):] == list(range(killed_at + 1, MAX_STEPS + 1))  # the resumed run's steps
    expected = _expected_order(MAX_STEPS)
    for row in rows:  # the killed run's steps (some redone after the kill) and the resumed run's
        assert row["data/task_ids"] == expected[row["step"] - 1], row["step"]
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", f"step_{MAX_STEPS - 1:08d}", f"step_{MAX_STEPS:08d}"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_stops_the_run_and_its_tool_service(tmp_path):
    """kill / SLURM's time limit: the run logs the signal, exits 143 promptly, and leaves nothing running."""
    import re
    import urllib.request

    out = tmp_path / "run"
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(_cmd(out), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=err, text=True)
        deadline = time.monotonic() + 600
        while _latest_step(out) < 1:  # mid-run: the second step's rollouts are under way
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    text = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "stopping on signal 15" in text
    url = re.search(r"tool service started at (http://\S+)", text).group(1)
    with pytest.raises(OSError):  # the service the run started is gone
        urllib.request.urlopen(f"{url}/healthz", timeout=2)
