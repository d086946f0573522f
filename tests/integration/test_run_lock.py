"""Run control across processes: the run folder's lock, a bad task file refused before anything starts,
ranks agreeing on stopping and saving."""

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_orchestra.runtime import run_control as rc
from tests.unit.test_run_control import _task

ROOT = Path(__file__).resolve().parents[2]


HOLD = """
import sys, time
from nemo_orchestra.runtime.run_control import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


def _holder(folder):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_launch_stops_at_once_naming_the_holder(tmp_path):
    proc = _holder(tmp_path)
    try:
        t0 = time.monotonic()
        with pytest.raises(rc.RunLocked) as e:
            rc.RunLock(str(tmp_path)).acquire()
        assert time.monotonic() - t0 < 2
        assert f"in use by pid {proc.pid} on {os.uname().nodename}" in str(e.value)
        assert str(tmp_path / "run.lock") in str(e.value) and "\n" not in str(e.value)
    finally:
        proc.kill()
        proc.wait()


def test_a_lock_left_by_a_killed_process_is_taken_over_and_said(tmp_path, caplog):
    proc = _holder(tmp_path)
    proc.kill()  # SIGKILL: it never released the lock
    proc.wait()
    with caplog.at_level(logging.WARNING), rc.RunLock(str(tmp_path)):
        held = json.loads((tmp_path / "run.lock").read_text())
        assert held == {"host": os.uname().nodename, "pid": os.getpid()}
    assert f"took over the lock of pid {proc.pid}" in caplog.text
    assert (tmp_path / "run.lock").read_text() == ""  # released: the next run starts silently
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        rc.RunLock(str(tmp_path)).acquire().release()
    assert "took over" not in caplog.text


def test_the_recipe_refuses_a_bad_task_file_before_starting_anything(tmp_path):
    (tmp_path / "eval.jsonl").write_text(_task(0) + "\n{oops\n")
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes/grpo_orchestrator.py"),
            f"run.output_dir={tmp_path / 'run'}",
            f"data.eval_path={tmp_path / 'eval.jsonl'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert (
        r.stderr.strip() == f"config error: data.eval_path: {tmp_path / 'eval.jsonl'}:2: not valid JSON "
        "(Expecting property name enclosed in double quotes)"
    )
    assert not (tmp_path / "run").exists() and time.monotonic() - t0 < 60


def _agree_rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:  # rank 1 got the signal, rank 0's clock says a save is due: both stop and both save
        flags = rc.agree([rank == 1, rank == 0])
        Path(out, f"rank{rank}").write_text(json.dumps(flags))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_stopping_and_saving(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_agree_rank, args=(f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2)
    assert [json.loads((tmp_path / f"rank{r}").read_text()) for r in (0, 1)] == [[True, True], [True, True]]
