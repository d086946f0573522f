"""Run folders and what a run writes in them are its user's alone (0700 folders, 0600 files)."""

from __future__ import annotations

import os
import stat

import pytest

from nemo_orchestra.runtime.run_control import RunLock, private_run_folder


@pytest.fixture
def umask_restored():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_run_folder_and_its_files_are_private(tmp_path, umask_restored):
    run = tmp_path / "run"
    private_run_folder(str(run))
    (run / "heldout.jsonl").write_text("{}\n")
    os.makedirs(run / "checkpoints" / "step_1")
    with RunLock(str(run)):
        pass
    assert mode(run) == 0o700 and mode(run / "heldout.jsonl") == 0o600
    assert mode(run / "checkpoints") == 0o700 and mode(run / "run.lock") == 0o600


def test_an_earlier_runs_open_folder_is_closed(tmp_path, umask_restored):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)
    (run / "samples.jsonl").write_text("{}\n")
    os.chmod(run / "samples.jsonl", 0o644)
    private_run_folder(str(run))
    assert mode(run) == 0o700  # others can no longer reach the 0644 file inside
