"""A training run whose tool service is killed mid-run restarts it, redoes the step's rollouts and
finishes (the service was started by the run itself, which is its only user); the step metrics
count the restart (``tools_env/restarts``)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import SHORT_RUN

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 5
ARGS = [
    f"trainer.max_steps={MAX_STEPS}",
    "checkpoint.save_every=1",
    "checkpoint.keep=1",
    "warm_start.steps=2",
    "warm_start.num_episodes=16",
    *SHORT_RUN,
    "export.enabled=false",
]


def _service_pid(url: str) -> int:
    import psutil

    port = int(url.rsplit(":", 1)[1])
    pids = [c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == "LISTEN"]
    assert pids, f"nothing listens on {url}"
    return pids[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_tool_service_is_restarted_and_the_run_finishes(tmp_path):
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    cmd = [sys.executable, str(ROOT / "recipes/grpo_orchestrator.py"), *ARGS, f"run.output_dir={out}"]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**env, "PYTHONWARNINGS": "ignore"}, stdout=subprocess.DEVNULL, stderr=err, text=True
        )
        deadline = time.monotonic() + 600
        while not (out / "checkpoints" / "latest").is_file():  # GRPO is under way
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.2)
        url = re.search(r"tool service started at (http://\S+)", log.read_text()).group(1)
        os.killpg(_service_pid(url), signal.SIGKILL)  # the whole service, as an OOM kill would
        code = proc.wait(timeout=600)
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert re.search(rf"tool service {re.escape(url)} stopped answering during step \d+'s rollouts", text), text[-4000:]
    assert "tool service restarted at" in text
    assert (out / "checkpoints" / f"step_{MAX_STEPS:08d}").is_dir()
    # the restart is in the step metrics too: 0 before the kill, 1 from the step it happened in on
    counts = [json.loads(line)["tools_env/restarts"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(counts) == MAX_STEPS and counts[0] == 0 and counts[-1] == 1, counts
    assert counts == sorted(counts), counts
