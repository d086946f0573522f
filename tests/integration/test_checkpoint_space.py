"""A full disk is a one-line error naming the path and the bytes, with the partial folder removed
and the previous checkpoint intact; a free-space check before each save; a ``latest`` naming a
missing or unreadable folder is reported and the newest intact checkpoint used."""

import errno
import logging
import os
import shutil
import subprocess
from collections import namedtuple

import pytest

from nemo_orchestra.train import checkpoint as ckpt
from nemo_orchestra.train.checkpoint import CheckpointSpaceError, latest_checkpoint, save_checkpoint


def writer(size: int, fail_with: BaseException | None = None):
    """A stand-in for dist_ckpt.save that writes ``size`` bytes of shards (then raises ``fail_with``)."""

    def save(folder, policy=None, gpt=None, common=None):
        with open(os.path.join(folder, "__0_0.distcp"), "wb") as f:
            for _ in range(size // 4096):
                f.write(b"\1" * 4096)
                f.flush()
        if fail_with is not None:
            raise fail_with

    return save


@pytest.fixture(autouse=True)
def _plain_rng(monkeypatch):
    monkeypatch.setattr(ckpt, "rng_state", lambda: {"seed": 1})
    ckpt._VERIFIED.clear()


def _save(root, step):
    return save_checkpoint(str(root), step, learner=None, extra={}, keep=3, rank=0)


def test_running_out_of_space_mid_save_is_one_line_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.dist_ckpt, "save", writer(8192))
    previous = _save(tmp_path, 1)
    failure = RuntimeError("CheckpointException ranks:{0: [Errno 28] No space left on device}")
    failure.__cause__ = OSError(errno.ENOSPC, "No space left on device")  # as torch's writer reports it
    monkeypatch.setattr(ckpt.dist_ckpt, "save", writer(4096, failure))
    with pytest.raises(CheckpointSpaceError) as e:
        _save(tmp_path, 2)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path}/step_00000002.tmp: no space left on device after 4096 bytes")
    assert f"the checkpoint needs about {ckpt.checkpoint_bytes(previous)} bytes (the size of step_00000001)" in message
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000001"]  # the partial folder is gone
    assert latest_checkpoint(str(tmp_path)) == previous


def test_other_errors_are_not_called_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.dist_ckpt, "save", writer(4096, OSError(errno.EACCES, "Permission denied")))
    with pytest.raises(PermissionError):
        _save(tmp_path, 1)


def test_the_free_space_check_stops_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.dist_ckpt, "save", writer(64 * 1024))
    previous = _save(tmp_path, 1)
    needed = ckpt.checkpoint_bytes(previous)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - needed + 1, needed - 1))
    with pytest.raises(CheckpointSpaceError) as e:
        _save(tmp_path, 2)
    assert str(e.value) == (
        f"{tmp_path}: {needed - 1} bytes free, a checkpoint needs about {needed} "
        "(the size of step_00000001); free space or move run.output_dir"
    )
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000001"]


def test_a_real_full_tmpfs(tmp_path, monkeypatch):
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        shutil.which("mount") is None
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("no permission to mount a tmpfs here")
    try:
        monkeypatch.setattr(ckpt.dist_ckpt, "save", writer(512 * 1024))  # twice the disk
        with pytest.raises(CheckpointSpaceError) as e:
            _save(disk, 1)
        assert str(e.value).startswith(f"{disk}/step_00000001.tmp: no space left on device after ")
        assert "the checkpoint needs more than" in str(e.value) and os.listdir(disk) == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("pointer", [b"step_00000009", b"\xff\xfe not text"])
def test_a_latest_naming_a_missing_or_unreadable_folder_is_said(tmp_path, monkeypatch, caplog, pointer):
    monkeypatch.setattr(ckpt.dist_ckpt, "save", writer(4096))
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    (tmp_path / "latest").write_bytes(pointer)
    ckpt._VERIFIED.clear()
    with caplog.at_level(logging.WARNING, logger="nemo_orchestra.train.checkpoint"):
        assert latest_checkpoint(str(tmp_path)) == newest
    assert "latest names" in caplog.text and "which is not there" in caplog.text and "step_00000002" in caplog.text
