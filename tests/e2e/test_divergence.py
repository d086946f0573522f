"""A diverging run (``optim.lr=1e30`` on the default CPU run, fp32) stops: its optimizer steps with
non-finite gradients are skipped, and after ``trainer.max_skipped_steps`` in a row it exits non-zero
with one line naming the step and ``optim.lr``, no traceback on the console. Every checkpoint it
leaves, the one ``latest`` names included, holds finite values only, and metrics.jsonl is strict JSON."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import SHORT_RUN

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 8
ARGS = [
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.max_skipped_steps=3",
    "checkpoint.save_every=1",
    "checkpoint.keep=20",
    "warm_start.steps=1",
    "warm_start.num_episodes=8",
    *SHORT_RUN,
    "export.enabled=false",
    "optim.lr=1e30",
]


def _strict(line: str) -> dict:
    def refuse(token):
        raise ValueError(f"metrics.jsonl is not strict JSON: {token}")

    return json.loads(line, parse_constant=refuse)


def _all_finite(folder: Path) -> bool:
    from torch.distributed.checkpoint import FileSystemReader, load

    reader = FileSystemReader(str(folder))
    tensors = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in reader.read_metadata().state_dict_metadata.items()
        if hasattr(m, "size") and m.properties.dtype.is_floating_point
    }
    load(tensors, storage_reader=reader, no_dist=True)
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_diverging_run_stops_with_one_line_and_leaves_finite_checkpoints(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes/grpo_orchestrator.py"), *ARGS, f"run.output_dir={out}"],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
        env={**env, "PYTHONWARNINGS": "ignore"},
    )
    err = r.stderr
    assert r.returncode != 0, err[-4000:]
    assert "Traceback" not in err and "Traceback" not in r.stdout, err[-4000:]
    lines = [line for line in err.replace("\r", "\n").splitlines() if "diverged" in line]
    assert len(lines) == 1, err[-4000:]
    found = re.search(r"training diverged at step (\d+): .* \(lower optim\.lr, now 1e\+30\)", lines[0])
    assert found, lines[0]
    step = int(found.group(1))
    assert step < MAX_STEPS

    rows = [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, step))  # the diverged step is not recorded
    skipped = [row for row in rows if row["train/step_skipped"]]
    assert skipped and all(row["train/grad_norm"] is None for row in skipped)  # null, not NaN
    assert rows[-1]["train/steps_skipped_total"] == len(skipped)

    ckpts = out / "checkpoints"
    saved = sorted(p for p in ckpts.iterdir() if p.name.startswith("step_"))
    assert saved and int(saved[-1].name.split("_")[1]) < step
    assert (ckpts / "latest").read_text().strip() == saved[-1].name
    assert all(_all_finite(p) for p in saved), [p.name for p in saved if not _all_finite(p)]
