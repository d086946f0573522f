"""Checkpoint integrity: a manifest of sizes and sha256 digests, written last; resume falls back past a
damaged newest checkpoint with a warning naming the file, or stops with one line naming it."""

import json
import logging
import os
from types import SimpleNamespace

import pytest

from nemo_orchestra.train import checkpoint as ckpt
from nemo_orchestra.train.checkpoint import (
    MANIFEST,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    main,
    verify_checkpoint,
    write_manifest,
)


def make(root, step, seal=True):
    """A checkpoint-shaped folder: two shard files, a nested one, ``latest`` pointing at it."""
    folder = root / f"step_{step:08d}"
    (folder / "sub").mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * (40 + step))
    (folder / "common.pt").write_bytes(b"step %d" % step)
    (folder / "sub" / "x.bin").write_bytes(b"\1" * 1000)
    if seal:
        write_manifest(str(folder))
    (root / "latest").write_text(folder.name)
    ckpt._VERIFIED.clear()
    return folder


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_size_and_digest(tmp_path):
    folder = make(tmp_path, 1)
    files = json.loads((folder / MANIFEST).read_text())["files"]
    assert sorted(files) == ["__0_0.distcp", "common.pt", "sub/x.bin"]
    assert files["common.pt"] == {"size": 6, "sha256": __import__("hashlib").sha256(b"step 1").hexdigest()}
    verify_checkpoint(str(folder))
    assert latest_checkpoint(str(tmp_path)) == str(folder)


@pytest.mark.parametrize(
    "damage, words",
    [
        (
            lambda f: (f / "__0_0.distcp").write_bytes((f / "__0_0.distcp").read_bytes()[:100]),
            "__0_0.distcp: 100 bytes",
        ),
        (lambda f: flip_a_byte(f / "sub" / "x.bin"), "sub/x.bin: sha256 differs"),
        (lambda f: (f / "common.pt").unlink(), "common.pt: missing"),
        (lambda f: (f / MANIFEST).unlink(), f"no {MANIFEST}"),
        (lambda f: (f / MANIFEST).write_text((f / MANIFEST).read_text()[:40]), "unreadable manifest"),
    ],
)
def test_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, caplog, damage, words):
    older = make(tmp_path, 1)
    newest = make(tmp_path, 2)
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="nemo_orchestra.train.checkpoint"):
        assert latest_checkpoint(str(tmp_path)) == str(older)
    assert words in caplog.text and "step_00000002" in caplog.text
    assert f"resuming from {older}" in caplog.text


def test_no_intact_checkpoint_stops_with_one_line_naming_the_file(tmp_path):
    make(tmp_path, 1, seal=False)  # written before manifests existed
    newest = make(tmp_path, 2)
    flip_a_byte(newest / "__0_0.distcp")
    with pytest.raises(CheckpointError) as e:
        latest_checkpoint(str(tmp_path))
    message = str(e.value)
    assert "\n" not in message and str(newest / "__0_0.distcp") in message and "1 older one(s)" in message


def test_a_checkpoint_without_a_valid_manifest_is_never_loaded(tmp_path):
    folder = make(tmp_path, 1, seal=False)
    with pytest.raises(CheckpointError, match="seal"):
        load_checkpoint(str(folder), learner=None, rank=0)  # refused before the policy is touched
    assert main(["verify", str(folder)]) == 1
    assert main(["seal", str(folder)]) == 0 and main(["verify", str(folder)]) == 0
    assert latest_checkpoint(str(tmp_path)) == str(folder)


def test_a_latest_pointer_to_a_missing_folder_falls_back(tmp_path):
    older = make(tmp_path, 1)
    (tmp_path / "latest").write_text("step_00000009")
    assert latest_checkpoint(str(tmp_path)) == str(older)
    assert latest_checkpoint(str(tmp_path / "nothing-here")) is None


def test_save_writes_the_manifest_over_every_file(tmp_path, monkeypatch):
    def fake_save(folder, policy=None, gpt=None, common=None):
        assert not os.listdir(folder)
        with open(os.path.join(folder, "__0_0.distcp"), "wb") as f:
            f.write(b"weights")
        os.mkdir(os.path.join(folder, "common"))
        with open(os.path.join(folder, "common", "state.json"), "w") as f:
            json.dump(common, f)

    monkeypatch.setattr(ckpt.dist_ckpt, "save", fake_save)
    monkeypatch.setattr(ckpt, "rng_state", lambda: {"seed": 1})
    final = ckpt.save_checkpoint(str(tmp_path), 3, learner=None, extra={}, keep=2, rank=0)
    files = json.loads(open(os.path.join(final, MANIFEST)).read())["files"]
    assert sorted(files) == ["__0_0.distcp", "common/state.json", "rng_rank_00000.pt"]
    ckpt._VERIFIED.clear()
    assert latest_checkpoint(str(tmp_path)) == final


def test_the_trainer_stops_in_one_line_when_nothing_is_intact(tmp_path):
    from nemo_orchestra.train.trainer import Trainer

    folder = make(tmp_path, 4)
    (folder / "common.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        Trainer.resume(SimpleNamespace(), str(tmp_path))
    assert str(e.value).startswith("error: cannot resume: no intact checkpoint") and "common.pt" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_checkpoint_is_hashed_once_per_process(tmp_path, monkeypatch):
    """A resume finds the newest intact checkpoint twice (``check_resume``, then the resume itself):
    its files are read and hashed the first time only."""
    make(tmp_path, 1)
    newest = make(tmp_path, 2)
    hashed = []
    digests = ckpt._digests
    monkeypatch.setattr(ckpt, "_digests", lambda folder, names: hashed.append(folder) or digests(folder, names))
    assert latest_checkpoint(str(tmp_path)) == str(newest)
    assert latest_checkpoint(str(tmp_path)) == str(newest)
    assert hashed == [str(newest)]
