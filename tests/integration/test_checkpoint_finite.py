"""A checkpoint holding a NaN (written by a version that saved a diverged run) is refused at load,
naming the tensor; a finite one restores the skipped-step count and the step with the weights.
(Integration tier: Megatron's checkpoint writer starts a process.)"""

import math

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.train import checkpoint as ckpt
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


def _trained(cfg):
    policy = build_learner(cfg, VOCAB, torch.device("cpu"))
    train_step(policy, pack([traj(ids=list(range(1, 20)), mask=[0] * 4 + [1] * 15)], 64), warm_start_loss_fn)
    return policy


def _save(root, step, policy, cfg):
    return ckpt.save_checkpoint(str(root), step, policy, {"data_position": step}, 2, 0, cfg.model, VOCAB)


def test_a_non_finite_checkpoint_is_refused_at_load(cfg, tmp_path, monkeypatch):
    policy = _trained(cfg)
    with torch.no_grad():
        dict(policy.module.named_parameters())["decoder.final_layernorm.weight"][0] = math.nan
    monkeypatch.setattr(ckpt, "check_finite", lambda *a: None)  # as a version before the check saved it
    folder = _save(tmp_path, 1, policy, cfg)
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(str(tmp_path)) == folder  # intact by its manifest: its bytes are what was saved
    with pytest.raises(ckpt.NonFiniteCheckpoint) as e:
        ckpt.load_checkpoint(folder, build_learner(cfg, VOCAB, torch.device("cpu")), rank=0)
    assert str(e.value) == (
        f"{folder}: not loaded (saved by a run that had diverged; resume from an earlier one): "
        "model.decoder.final_layernorm.weight holds non-finite values (NaN or inf)"
    )


def test_a_finite_checkpoint_carries_the_step_and_the_skipped_count(cfg, tmp_path):
    policy = _trained(cfg)
    policy.guard.total = 2
    folder = _save(tmp_path, 7, policy, cfg)
    fresh = build_learner(cfg, VOCAB, torch.device("cpu"))
    assert ckpt.load_checkpoint(folder, fresh, rank=0)["step"] == 7
    assert fresh.guard.total == 2  # the step is the trainer's, from the returned state
