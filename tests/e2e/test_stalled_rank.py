"""A rank stopped mid-run (SIGSTOP: a frozen process, a hung node) under torchrun with two
data-parallel ranks: the other rank names it and its step in one line within ``run.stall_timeout_s``,
the job ends, nothing of it is left running, and the last checkpoint is intact to resume from."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_orchestra.train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STALL_S = 20
ARGS = [
    "parallel=single",
    "rollout.engine=hf",
    "warm_start.steps=2",
    "warm_start.num_episodes=8",
    "data.num_train_tasks=16",
    "data.prompts_per_step=1",
    "rollout.group_size=2",
    "rollout.max_turns=2",
    "rollout.max_new_tokens_per_turn=16",
    "evaluation.enabled=false",
    "export.enabled=false",
    "trainer.max_steps=200",
    "checkpoint.save_every=1",
    f"run.stall_timeout_s={STALL_S}",
]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for every purpose here
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(600)
def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "recipes/grpo_orchestrator.py"), *ARGS, f"run.output_dir={out}"]
    log = open(tmp_path / "log.txt", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    stopped = None
    try:
        deadline = time.monotonic() + 400
        while latest_checkpoint(str(out / "checkpoints")) is None:  # GRPO is under way
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(0.5)
        stopped = json.loads((out / ".heartbeats" / "rank-1").read_text())["pid"]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        code = proc.wait(timeout=STALL_S + 120)
        took = time.monotonic() - t0
        for _ in range(100):  # the stopped rank is ended with the job
            if not _alive(stopped):
                break
            time.sleep(0.1)
        left = _alive(stopped)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if stopped and _alive(stopped):
            os.kill(stopped, signal.SIGKILL)
    text = (tmp_path / "log.txt").read_text()
    assert code != 0 and took < STALL_S + 90, (took, text[-3000:])
    lines = [ln for ln in text.splitlines() if "has made no progress" in ln]
    assert lines, text[-3000:]
    assert f"rank 1 (pid {stopped} on " in lines[0] and "at step " in lines[0] and "run.stall_timeout_s" in lines[0]
    assert not left, "the stopped rank was left behind"
    assert latest_checkpoint(str(out / "checkpoints")) is not None  # intact, to resume from
