"""Each local rank's vLLM engine is pinned to the rank's own GPU: checked under a 2-rank gloo launch
by the CUDA_VISIBLE_DEVICES a process started by the engine would see."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _launch(tmp_path, visible: str | None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    out = tmp_path / "answers.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / "integration" / "distributed" / "pinning_rank.py"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return sorted(json.loads(out.read_text()), key=lambda a: a["rank"])


@pytest.mark.distributed
def test_each_rank_engine_sees_only_its_own_gpu(tmp_path):
    answers = _launch(tmp_path, None)
    assert [a["engine_sees"] for a in answers] == ["0", "1"]
    assert [a["trainer_keeps"] for a in answers] == [None, None]  # the trainer's own view is unchanged


@pytest.mark.distributed
def test_pinning_follows_the_launchers_gpu_list(tmp_path):
    answers = _launch(tmp_path, "3,5")  # e.g. SLURM gave this job GPUs 3 and 5
    assert [a["engine_sees"] for a in answers] == ["3", "5"]
    assert [a["trainer_keeps"] for a in answers] == ["3,5", "3,5"]


def test_a_rank_without_a_gpu_is_an_error():
    from nemo_orchestra.rollout.engines.vllm_memory import engine_visible_devices

    assert engine_visible_devices(1, "2, 7") == "7"
    with pytest.raises(ValueError, match="local rank 2 has no GPU"):
        engine_visible_devices(2, "2,7")
