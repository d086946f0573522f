"""The sbatch template's requeue path, with Slurm's commands replaced by small scripts: the batch
shell gets SIGUSR1 (``--signal=B:USR1@N``), its trap writes the stop file, the job (here the run's
own stop/requeue functions, without the training) sees it, asks to be requeued, and the template
runs ``scontrol requeue`` — or does not, once ``run.max_restarts`` is reached."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "recipes" / "slurm" / "grpo_orchestrator.sbatch"

JOB = textwrap.dedent("""
    import os, signal, sys, time
    from nemo_orchestra.runtime import run_control as rc

    stop = rc.StopSignals(signal.SIGUSR1)  # what the recipe checks between steps
    open(os.environ["READY"], "w").close()
    while not stop.requested():
        time.sleep(0.05)
    sys.exit(rc.REQUEUE_EXIT if rc.request_requeue(max_restarts=2) else 128 + stop.signum)
""")


def _fake_slurm(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "scontrol": 'if [ "$1" = show ]; then echo localhost; else echo "$@" >> "$CALLS"; fi',
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',
        "torchrun": f'exec {sys.executable} "$JOB"',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text("")
    (tmp_path / "job.py").write_text(JOB)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "CALLS": str(tmp_path / "calls"),
        "JOB": str(tmp_path / "job.py"),
        "READY": str(tmp_path / "ready"),
    }


def _run_to_the_signal(tmp_path, env):
    proc = subprocess.Popen(
        ["bash", str(SBATCH), "run.output_dir=x"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # Slurm's B: signal goes to the batch shell only
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


@pytest.mark.parametrize("restarts, requeued", [(None, True), ("2", False)])
def test_the_pre_timeout_signal_checkpoints_and_requeues_until_max_restarts(tmp_path, restarts, requeued):
    env = _fake_slurm(tmp_path)
    env.pop("SLURM_RESTART_COUNT", None)
    if restarts:
        env["SLURM_RESTART_COUNT"] = restarts
    code, out = _run_to_the_signal(tmp_path, env)
    calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    if requeued:
        assert code == 0, out
        assert calls == "requeue 42\n" and "requeueing job 42 (restart 1)" in out
    else:
        assert code == 128 + signal.SIGUSR1 and calls == "", out
    assert "asking the run to checkpoint and stop" in out
    assert not list(tmp_path.glob(".nemo-orchestra-42.*"))  # stop and requeue files cleaned up
