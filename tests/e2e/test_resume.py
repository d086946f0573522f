"""A run survives its interruptions: stopped by SIGTERM, killed by SIGKILL and stopped by the
preempt signal (SIGUSR1, Slurm's ``--signal=B:USR1@N``) at random steps, and relaunched by the same
command each time, it ends with the weights of an uninterrupted run of the same seed, bit for bit
(the in-process hf engine on CPU), every step recorded once with the uninterrupted run's figures,
and no process or temporary folder of any launch left behind.

The data order of an uninterrupted run is ``DataOrder.tasks_at(step)``; every step logs the task
ids it used (``data/task_ids``), checked against it.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import SHORT_RUN

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 7
ARGS = [
    f"trainer.max_steps={MAX_STEPS}",
    "checkpoint.save_every=1",
    "checkpoint.keep=2",
    "warm_start.steps=1",
    "warm_start.num_episodes=8",
    *SHORT_RUN,
    "export.enabled=true",
    # the barely warm-started policy earns no reward: zero-variance groups are kept and weight decay
    # moves it off the reference, so every step updates the weights through the KL term's gradient
    "advantage.min_group_std=-1",
    "advantage.drop_format_errors=false",  # and so are its malformed rollouts
    "optim.weight_decay=0.1",
]
VOLATILE = ("time", "time/", "perf/")  # wall-clock figures differ between runs; everything else must not


def _cmd(out):
    return [sys.executable, str(ROOT / "recipes/grpo_orchestrator.py"), *ARGS, f"run.output_dir={out}"]


def _short_tmp(tmp_path: Path) -> Path:
    """A TMPDIR for the launches: in /tmp, since pytest's folders are too deep for the socket paths
    multiprocessing makes inside it; a link in ``tmp_path`` names it for ``_remove_short_tmps``."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    (tmp_path / f"tmpdir-{folder.name}").symlink_to(folder)
    return folder


@pytest.fixture(autouse=True)
def _remove_short_tmps(tmp_path):
    yield
    import shutil

    for link in tmp_path.glob("tmpdir-*"):
        shutil.rmtree(link.resolve(), ignore_errors=True)


def _env(tmp: Path):
    drop = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "NEMO_ORCHESTRA_RUN", "NEMO_ORCHESTRA_RESTARTS")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp)}


def _latest_step(out: Path) -> int:
    try:
        return int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])
    except (OSError, IndexError, ValueError):
        return 0


def _wait_for_step(out: Path, step: int, proc, log: Path):
    deadline = time.monotonic() + 300
    while _latest_step(out) < step:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint of step {step} within 5 minutes"
        time.sleep(0.1)


def _marked(tmp: Path) -> list[int]:
    """Processes of the launches whose temporary folders are under ``tmp`` (their marker, runtime/reaper.py)."""
    needle = f"NEMO_ORCHESTRA_RUN_TMP={tmp}/".encode()
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and needle in Path(f"/proc/{name}/environ").read_bytes():
                found.append(int(name))
        except OSError:
            pass
    return found


def _assert_nothing_left(tmp: Path, children: list):
    """Within 10 s of the launch's end: no process of it, no temporary folder of it."""
    import psutil

    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running: {[' '.join(p.cmdline())[:120] for p in alive]}"

    def folders():  # torch's compile cache is meant to stay (reaper.contain keeps it out of the run's folder)
        return [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]

    deadline = time.monotonic() + 10
    while (_marked(tmp) or folders()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _marked(tmp), f"processes of the run left: {_marked(tmp)}"
    assert not folders(), f"temporary folders left in {tmp}: {folders()}"


def _children(proc):
    import psutil

    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _figures(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _expected_order(steps: int) -> list[list[str]]:
    """What an uninterrupted run feeds each step (the trainer's own function)."""
    from nemo_orchestra.config import load_config
    from nemo_orchestra.data.default_tasks import generate_tasks
    from nemo_orchestra.train.data_order import DataOrder

    cfg = load_config(ARGS)
    order = DataOrder(generate_tasks(cfg.data.num_train_tasks, cfg.run.seed), cfg.data.prompts_per_step, cfg.run.seed)
    return [[t.id for t in order.tasks_at(s)] for s in range(steps)]


def _interrupt(cmd, out, env, tmp, log, at_step, sig):
    """Launch ``cmd``, send ``sig`` once checkpoint ``at_step`` exists; returns (exit code, stderr)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _wait_for_step(out, at_step, proc, log)
        children = _children(proc)
        proc.send_signal(sig)
        proc.wait(timeout=300)
    _assert_nothing_left(tmp, children)
    return proc.returncode, log.read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_interruptions_end_with_the_uninterrupted_weights(tmp_path):
    from safetensors.torch import load_file

    rng = random.Random(os.environ.get("RESUME_TEST_SEED") or time.time_ns())
    a, b, c = sorted(rng.sample(range(1, MAX_STEPS), 3))  # a checkpoint each interruption waits for
    print(f"interruptions after checkpoints {a}, {b}, {c} (RESUME_TEST_SEED to repeat)")
    base, out, tmp = tmp_path / "uninterrupted", tmp_path / "run", _short_tmp(tmp_path)
    env = _env(tmp)
    with open(tmp_path / "base.txt", "w") as err:  # alongside: it shares nothing with the interrupted run
        baseline = subprocess.Popen(
            _cmd(base), cwd=ROOT, env=_env(_short_tmp(tmp_path)), stdout=subprocess.DEVNULL, stderr=err
        )

    code, text = _interrupt(_cmd(out), out, env, tmp, tmp_path / "1.txt", a, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, text[-3000:]
    stopped_at = _latest_step(out)
    assert f"stopped by SIGTERM after step {stopped_at}: checkpoint {out}/checkpoints/step_{stopped_at:08d}" in text
    assert "resume with: " in text and "Traceback" not in text

    code, text = _interrupt(_cmd(out), out, env, tmp, tmp_path / "2.txt", max(b, stopped_at + 1), signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert f"at step {stopped_at}" in text  # "resumed from .../step_0000000N at step N"

    wrapper = [sys.executable, str(ROOT / "scripts/requeue_local.py"), "--", *_cmd(out)]
    killed_at = _latest_step(out)
    code, text = _interrupt(wrapper, out, env, tmp, tmp_path / "3.txt", max(c, killed_at + 1), signal.SIGUSR1)
    assert code == 0, text[-3000:]
    assert f"at step {killed_at}" in text
    assert "took over the lock" in text  # the killed launch's lock
    # after a step, or after the last one (during the export) when the draws leave no step between,
    # or once the run has ended (the signal came while the interpreter exited: nothing to requeue)
    outside = "stopped by SIGUSR1 outside a GRPO step" in text
    ended = "SIGUSR1 received after the run ended (exit code 0): nothing to stop" in text
    assert "stopped by SIGUSR1 after step" in text or outside or ended, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert ended or "requeue_local: relaunching (restart 1)" in text
    assert baseline.wait(timeout=300) == 0, (tmp_path / "base.txt").read_text()[-3000:]

    rows, expected = _rows(out), _expected_order(MAX_STEPS)
    assert not any(r.get("train/step_skipped") for r in rows) and any(r["loss/kl"] > 0 for r in rows)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))  # each step once
    assert [r["data/task_ids"] for r in rows] == expected
    assert [_figures(r) for r in rows] == [_figures(r) for r in _rows(base)]
    samples = [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples == sorted(samples) and sorted(set(samples)) == list(range(1, MAX_STEPS + 1))
    mine, theirs = load_file(out / "hf" / "model.safetensors"), load_file(base / "hf" / "model.safetensors")
    assert sorted(mine) == sorted(theirs)
    different = [k for k in mine if not mine[k].equal(theirs[k])]
    assert not different, f"weights differ from the uninterrupted run: {different[:5]}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_stops_with_one_line_and_no_leak(tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group: no traceback, no leaked
    shared memory, a checkpoint of the last step and the resume command."""
    out, tmp, log = tmp_path / "run", _short_tmp(tmp_path), tmp_path / "err.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            _cmd(out), cwd=ROOT, env=_env(tmp), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )  # a group of its own, as a shell's job
        _wait_for_step(out, 1, proc, log)
        children = _children(proc)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=300)
    _assert_nothing_left(tmp, children)
    text = log.read_text()
    assert proc.returncode == 128 + signal.SIGINT, text[-3000:]
    assert "stopped by SIGINT after step" in text and "resume with: " in text
    for bad in ("Traceback", "KeyboardInterrupt", "leaked shared_memory", "RuntimeError"):
        assert bad not in text, text[-3000:]
