"""A diverging step: non-finite loss or gradients skip the optimizer step in every precision (fp32
included), leaving weights and optimizer state as they were and counting the skip;
``trainer.max_skipped_steps`` in a row stop the run with one line naming the step and the learning
rate; a step that leaves non-finite weights stops it at once; a checkpoint is never written with a
non-finite value, nor ``latest`` moved; ``loss/kl`` above ``trainer.kl_warn`` is said once."""

import logging
import math
import os

import pytest
import torch

from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.train import step as step_module
from nemo_orchestra.train.checkpoint import NonFiniteCheckpoint, save_checkpoint
from nemo_orchestra.train.divergence import StepGuard, TrainingDiverged, first_non_finite
from nemo_orchestra.train.packing import pack
from nemo_orchestra.train.learner import build_learner, set_lr
from nemo_orchestra.train.step import grpo_update, reference_logprobs, warm_start_loss_fn, train_step
from tests.helpers import TINY_MODEL, loss_cfg, traj

VOCAB = 256
TINY = [*TINY_MODEL, "optim.lr=1e-2"]


@pytest.fixture(scope="module", autouse=True)
def _distributed():
    init_distributed(load_config(TINY).parallel, seed=5)


def _policy(dtype="fp32", *overrides):
    return build_learner(load_config([*TINY, f"model.params_dtype={dtype}", *overrides]), VOCAB, torch.device("cpu"))


def _packs():
    return pack([traj(ids=list(range(1, 24)), mask=[0] * 4 + [1] * 19)], 64)


def _nan_loss(lp_T, batch):
    loss, n, metrics = warm_start_loss_fn(lp_T, batch)
    return loss * math.nan, n, {**metrics, "loss/nll": metrics["loss/nll"] * math.nan}


def _state(policy):
    """Copies of everything a step may change: the weights, and the optimizer's tensors (its
    moments, and the fp32 main copies of low-precision weights)."""
    out = [p.detach().clone() for p in policy.module.parameters()]
    for opt in policy.optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                out.append(p.detach().clone())
                out += [v.clone() for v in opt.optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
    return out


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_nan_loss_skips_the_step_and_leaves_weights_and_optimizer_state(dtype):
    policy = _policy(dtype)
    train_step(policy, _packs(), warm_start_loss_fn)  # a real step first: the optimizer has moments to keep
    before = _state(policy)
    out = train_step(policy, _packs(), _nan_loss)
    assert out["train/step_skipped"] == 1.0 and math.isnan(out["loss/nll"])
    assert _same(before, _state(policy))
    assert (policy.guard.in_a_row, policy.guard.total) == (1, 1)
    out = train_step(policy, _packs(), warm_start_loss_fn)  # a finite step again: taken, the count in a row reset
    assert out["train/step_skipped"] == 0.0 and not _same(before, _state(policy))
    assert (policy.guard.in_a_row, policy.guard.total) == (0, 1)


def test_an_inf_gradient_with_a_finite_loss_skips_the_step(monkeypatch):
    policy = _policy()
    train_step(policy, _packs(), warm_start_loss_fn)
    before = _state(policy)
    real = step_module.forward_backward

    def poisoned(policy, *args):
        out = real(policy, *args)
        next(policy.model.parameters()).main_grad.view(-1)[0] = math.inf
        return out

    monkeypatch.setattr(step_module, "forward_backward", poisoned)
    out = train_step(policy, _packs(), warm_start_loss_fn)
    assert out["train/step_skipped"] == 1.0 and math.isfinite(out["loss/nll"]) and math.isnan(out["train/grad_norm"])
    assert _same(before, _state(policy))
    assert policy.guard.total == 1


def test_consecutive_skips_stop_the_run_naming_the_step_and_the_learning_rate():
    policy = _policy("fp32", "trainer.max_skipped_steps=3", "optim.lr=1e30")
    policy.guard.step = 4
    for _ in range(2):
        train_step(policy, _packs(), _nan_loss)
    with pytest.raises(TrainingDiverged) as e:
        train_step(policy, _packs(), _nan_loss)
    assert str(e.value) == (
        "training diverged at step 4: non-finite loss or gradients in 3 consecutive optimizer steps "
        "(lower optim.lr, now 1e+30)"
    )
    assert "\n" not in str(e.value) and isinstance(e.value, RuntimeError)


def test_warm_start_divergence_names_warm_start_lr(monkeypatch):
    policy = _policy("fp32", "trainer.max_skipped_steps=2", "warm_start.lr=0.5")
    real = step_module.forward_backward

    def poisoned(policy, *args):
        out = real(policy, *args)
        next(policy.model.parameters()).main_grad.view(-1)[0] = math.nan
        return out

    monkeypatch.setattr(step_module, "forward_backward", poisoned)
    train_step(policy, _packs(), warm_start_loss_fn)
    with pytest.raises(TrainingDiverged) as e:
        train_step(policy, _packs(), warm_start_loss_fn)  # the warm start's own loss: its steps and its rate
    assert str(e.value) == (
        "training diverged at warm-start step 2: non-finite loss or gradients in 2 consecutive optimizer steps "
        "(lower warm_start.lr, now 0.5)"
    )


def test_a_step_that_makes_the_weights_non_finite_stops_at_once():
    policy = _policy()
    set_lr(policy.optimizer, math.inf)  # finite gradients, an infinite step
    with pytest.raises(TrainingDiverged, match="the optimizer step made the weights non-finite"):
        train_step(policy, _packs(), warm_start_loss_fn)


def test_grpo_update_names_the_trainers_step_and_reports_the_total():
    policy = _policy()
    g = torch.Generator().manual_seed(0)
    trajs = []
    for adv in (1.0, math.nan):  # a NaN advantage: a NaN loss
        t = traj(ids=torch.randint(1, VOCAB, (20,), generator=g).tolist(), mask=[0] * 5 + [1] * 15)
        t.advantage = adv
        trajs.append(t)
    (b,) = pack(trajs, capacity=128)
    b.ref_logprobs_T = reference_logprobs(policy, [b])[0]
    before = _state(policy)
    out = grpo_update(policy, [[b]], loss_cfg(), step=5)
    assert out["train/step_skipped"] == 1.0 and out["train/steps_skipped_total"] == 1.0
    assert policy.guard.step == 5 and _same(before, _state(policy))


def test_kl_above_the_bound_is_said_once(caplog):
    guard = StepGuard(kl_warn=10.0, lrs={"optim.lr": 10.0}, step=7)
    with caplog.at_level(logging.WARNING, logger="nemo_orchestra.train.divergence"):
        for kl in (1.0, math.nan, 4.8e8, 5e8):
            guard.check_kl(kl)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "step 7: loss/kl is 4.8e+08, above trainer.kl_warn=10" in lines[0] and "lower optim.lr (now 10)" in lines[0]
    StepGuard(kl_warn=None).check_kl(1e9)  # null: never


def test_the_keys_are_validated():
    with pytest.raises(ConfigError, match="trainer.max_skipped_steps"):
        load_config(["trainer.max_skipped_steps=0"])
    with pytest.raises(ConfigError, match="trainer.kl_warn"):
        load_config(["trainer.kl_warn=-1"])
    assert load_config(["trainer.kl_warn=null"]).trainer.kl_warn is None


def test_first_non_finite_names_the_first_bad_tensor():
    named = [
        ("a", torch.ones(3)),
        ("i", torch.tensor([1, 2])),
        ("b", torch.tensor([1.0, math.inf])),
        ("c", torch.tensor([math.nan])),
    ]
    assert first_non_finite(named) == "b"
    assert first_non_finite(named[:2]) is None and first_non_finite([]) is None


@pytest.mark.parametrize("where", ["weight", "optimizer"])
def test_a_checkpoint_with_a_non_finite_value_is_not_written_and_latest_stays(tmp_path, where):
    policy = _policy()
    train_step(policy, _packs(), warm_start_loss_fn)
    root = tmp_path / "checkpoints"
    (root / "step_00000001").mkdir(parents=True)  # the last good checkpoint, as far as this save knows
    (root / "latest").write_text("step_00000001")
    with torch.no_grad():
        if where == "weight":
            next(policy.module.parameters()).view(-1)[3] = math.nan
        else:
            inner = policy.optimizer.chained_optimizers[0].optimizer
            next(iter(inner.state.values()))["exp_avg"].view(-1)[0] = math.inf
    with pytest.raises(NonFiniteCheckpoint) as e:
        save_checkpoint(str(root), 2, policy, {"data_position": 2}, keep=3, rank=0)
    message = str(e.value)
    assert message.startswith(f"{root}/step_00000002: not written, and {root}/latest left as it was: ")
    assert message.endswith("holds non-finite values (NaN or inf)")
    assert ("model." in message) if where == "weight" else ("optimizer exp_avg of model." in message), message
    assert sorted(os.listdir(root)) == ["latest", "step_00000001"]
    assert (root / "latest").read_text() == "step_00000001"
