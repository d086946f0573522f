"""Truncated importance sampling (loss.tis_cap): hand-computed weights, where they apply, how they are packed."""

import math

import pytest
import torch

from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.grpo.loss import policy_loss, tis_weights
from nemo_orchestra.train.packing import pack
from nemo_orchestra.train.step import grpo_loss_fn
from tests.helpers import loss_cfg, traj

LOG = math.log


def test_weights_are_trainer_over_generator_probability_capped():
    old = torch.tensor([LOG(0.5), LOG(0.5), LOG(0.1)])
    gen = torch.tensor([LOG(0.25), LOG(0.1), LOG(0.2)])  # ratios 2, 5, 0.5
    assert tis_weights(old, gen, cap=3.0).tolist() == pytest.approx([2.0, 3.0, 0.5])


def test_weights_scale_the_policy_gradient_term_and_carry_no_gradient():
    lp = torch.log(torch.tensor([0.5, 0.25, 0.5])).requires_grad_()
    weights = torch.tensor([2.0, 0.5, 7.0], requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 0.0])
    adv = torch.full((3,), 2.0)
    loss, n, m = policy_loss(lp, lp.detach(), lp.detach(), adv, mask, loss_cfg(), is_weights_T=weights)
    assert n == 2
    assert loss.item() == pytest.approx(-2.0 * 2.0 - 2.0 * 0.5)  # -A w r, r = 1, masked token ignored
    assert m["loss/tis_weight_mean"].item() == pytest.approx(1.25)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-4.0, -1.0, 0.0])  # d(-A w r)/dlogp = -A w r
    assert weights.grad is None


def test_weights_leave_the_kl_term_alone():
    lp = torch.tensor([LOG(0.5)])
    ref = torch.tensor([LOG(0.25)])
    args = (lp, lp.clone(), ref, torch.zeros(1), torch.ones(1), loss_cfg(kl_coef=1.0))
    plain, _, _ = policy_loss(*args)
    weighted, _, _ = policy_loss(*args, is_weights_T=torch.tensor([10.0]))
    assert weighted.item() == pytest.approx(plain.item())


def test_clipped_and_weighted():
    old = torch.zeros(1)
    lp = torch.log(torch.tensor([2.0]))  # ratio 2 clips to 1.28
    loss, _, _ = policy_loss(lp, old, old, torch.ones(1), torch.ones(1), loss_cfg(), is_weights_T=torch.tensor([0.5]))
    assert loss.item() == pytest.approx(-0.64)


def test_pack_shifts_generator_logprobs_like_the_targets():
    t = traj(ids=[5, 6, 7, 8], mask=[0, 0, 1, 1])
    t.gen_logprobs = [0.0, 0.0, -0.5, -1.0]
    (b,) = pack([t], capacity=16, pad_to_multiple=3)  # 4 tokens + 2 of padding
    assert b.target_ids_T.tolist()[:3] == [6, 7, 8]
    assert b.loss_mask_T.tolist() == [0, 1, 1, 0, 0, 0]
    assert b.gen_logprobs_T.tolist() == [0.0, -0.5, -1.0, 0.0, 0.0, 0.0]


def test_grpo_loss_weights_by_the_packed_generator_logprobs_only_when_capped():
    t = traj(ids=[5, 6, 7], mask=[0, 1, 1])
    t.gen_logprobs = [0.0, LOG(0.25), LOG(0.1)]
    t.advantage = 1.0
    (b,) = pack([t], capacity=8)
    b.old_logprobs_T = torch.tensor([LOG(0.5), LOG(0.5), 0.0])  # trainer: weights 2 and 5 before the cap
    b.ref_logprobs_T = b.old_logprobs_T.clone()
    lp = b.old_logprobs_T.clone()  # ratio 1
    off, _, m_off = grpo_loss_fn(loss_cfg(tis_cap=None))(lp, b)
    on, _, m_on = grpo_loss_fn(loss_cfg(tis_cap=3.0))(lp, b)
    assert off.item() == pytest.approx(-2.0) and "loss/tis_weight_mean" not in m_off
    assert on.item() == pytest.approx(-(2.0 + 3.0))
    assert m_on["loss/tis_weight_mean"].item() == pytest.approx(2.5)


def test_config_key():
    assert load_config([]).loss.tis_cap is None
    assert load_config(["loss.tis_cap=2.0"]).loss.tis_cap == 2.0
    with pytest.raises(ConfigError, match="loss.tis_cap"):
        load_config(["loss.tis_cap=0"])
