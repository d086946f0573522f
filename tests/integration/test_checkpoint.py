"""Checkpoints: atomic folders, keep-N, latest, and a restore that gives back weights, optimizer and RNG."""

import os
import random

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.megatron.sharding import model_state
from nemo_orchestra.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from nemo_orchestra.train.packing import pack
from nemo_orchestra.train.learner import build_learner
from nemo_orchestra.train.step import warm_start_loss_fn, train_step
from tests.helpers import TINY_MODEL, traj

VOCAB = 256
TINY = [*TINY_MODEL, "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def cfg():
    cfg = load_config(TINY)
    init_distributed(cfg.parallel, seed=3)
    return cfg


def _step(policy):
    batch = pack([traj(ids=list(range(1, 20)), mask=[0] * 4 + [1] * 15)], 64)
    return train_step(policy, batch, warm_start_loss_fn)


def _save(root, step, policy, keep, cfg):
    return save_checkpoint(
        str(root), step, policy, {"data_position": step}, keep=keep, rank=0, model_cfg=cfg.model, vocab_size=VOCAB
    )


def _weights(policy):
    return {k: v.clone() for k, v in model_state(policy.module).items()}


def test_keeps_the_newest_and_points_latest_at_it(cfg, tmp_path):
    policy = build_learner(cfg, VOCAB, torch.device("cpu"))
    for step in (1, 2, 3):
        _step(policy)
        _save(tmp_path, step, policy, 2, cfg)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002", "step_00000003"]
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_00000003")


def test_a_crash_mid_write_leaves_the_previous_checkpoint(cfg, tmp_path):
    policy = build_learner(cfg, VOCAB, torch.device("cpu"))
    _step(policy)
    _save(tmp_path, 1, policy, 2, cfg)
    saved = _weights(policy)
    partial = tmp_path / "step_00000002.tmp"  # what a SIGKILL during the next save leaves behind
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 100)
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_00000001")
    fresh = build_learner(cfg, VOCAB, torch.device("cpu"))
    common = load_checkpoint(latest_checkpoint(str(tmp_path)), fresh, rank=0)
    assert common["step"] == 1 and common["data_position"] == 1
    assert all(torch.equal(saved[k], v) for k, v in _weights(fresh).items())
    _step(fresh)
    _save(tmp_path, 2, fresh, 2, cfg)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000001", "step_00000002"]


def test_restore_gives_back_weights_optimizer_reference_and_rng(cfg, tmp_path):
    policy = build_learner(cfg, VOCAB, torch.device("cpu"))
    _step(policy)
    policy.reset_reference()
    _step(policy)
    folder = _save(tmp_path, 7, policy, 1, cfg)
    first_draws = (torch.rand(3), random.random())  # the RNG right after the save
    after_a = _step(policy)
    weights_a = _weights(policy)

    other = build_learner(cfg, VOCAB, torch.device("cpu"))
    load_checkpoint(folder, other, rank=0)
    draws = (torch.rand(3), random.random())
    assert torch.equal(draws[0], first_draws[0]) and draws[1] == first_draws[1]
    ref_a = {k: v for k, v in model_state(policy.reference).items()}
    assert all(torch.equal(ref_a[k], v) for k, v in model_state(other.reference).items())
    after_b = _step(other)
    assert after_b["loss/nll"] == pytest.approx(after_a["loss/nll"], abs=1e-6)
    assert all(torch.allclose(weights_a[k], v, atol=1e-7, rtol=0) for k, v in _weights(other).items())
