"""The GRPO update: old logprobs from its own forward (one optimizer step per batch of rollouts)
give the gradient a separate old-logprob pass gives, and the reported trainer-generator mismatch
is the mean |old - generator| over generated tokens; after the warm start the optimizer's
moments are reset, so GRPO's first step is a fresh Adam step."""

import dataclasses
import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.megatron.cpu_compat import cuda_type_names
from nemo_orchestra.megatron.forward import forward_logprobs
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.megatron.sharding import model_state
from nemo_orchestra.train.packing import pack
from nemo_orchestra.train.learner import build_learner, reset_optimizer_state, set_lr
from nemo_orchestra.train import step as step_module
from nemo_orchestra.train.step import (
    ReferenceAhead,
    forward_backward,
    grpo_loss_fn,
    reference_logprobs,
    warm_start_loss_fn,
    train_step,
)
from tests.helpers import TINY_MODEL, loss_cfg, traj

VOCAB = 256
TINY = [*TINY_MODEL]


@pytest.fixture(scope="module")
def policy():
    cfg = load_config(TINY)
    info = init_distributed(cfg.parallel, seed=7)
    p = build_learner(cfg, VOCAB, info.device)  # the GPU where there is one
    with torch.no_grad():  # a reference that differs from the policy, so the KL term has a gradient
        for w in p.reference.parameters():
            w.add_(0.01 * torch.randn_like(w))
    return p


def _batch(policy, extra=()):
    g = torch.Generator().manual_seed(0)
    trajs = []
    for k, adv in enumerate((1.5, -0.7, 0.3)):
        n = 12 + 5 * k
        t = traj(ids=torch.randint(1, VOCAB, (n,), generator=g).tolist(), mask=[0] * 5 + [1] * (n - 5))
        t.advantage = adv
        t.gen_logprobs = [0.0] * 5 + (-torch.rand(n - 5, generator=g) * 3).tolist()
        trajs.append(t)
    (b,) = pack(trajs + list(extra), capacity=128)
    b.ref_logprobs_T = reference_logprobs(policy, [b])[0]
    return b


def _grads(policy, batch, cfg):
    metrics = forward_backward(policy, [batch], grpo_loss_fn(cfg))
    return [p.main_grad.clone() for p in policy.model.parameters()], metrics[0]


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_own_forward_old_logprobs_equal_a_separate_pass(policy, tis_cap):
    cfg = loss_cfg(tis_cap=tis_cap, kl_coef=0.1)
    on_policy = _batch(policy)
    assert on_policy.old_logprobs_T is None  # what pack leaves for the update to fill
    separate = dataclasses.replace(
        on_policy, old_logprobs_T=forward_logprobs(policy.model, [on_policy], policy.device)[0]
    )
    g_own, m_own = _grads(policy, on_policy, cfg)
    g_sep, m_sep = _grads(policy, separate, cfg)
    assert max(float((a - b).abs().max()) for a, b in zip(g_own, g_sep)) < 1e-6
    assert any(float(a.abs().max()) > 0 for a in g_own)
    mask = on_policy.loss_mask_T.bool()
    expected = (separate.old_logprobs_T - on_policy.gen_logprobs_T)[mask].abs().mean()
    assert float(m_own["rollout/logprob_mismatch"]) == pytest.approx(float(expected), abs=1e-5)
    assert float(m_own["loss/ratio_mean"]) == pytest.approx(1.0)
    # a stale old policy (as after an earlier update) gives another gradient: the test can tell them apart
    stale = dataclasses.replace(separate, old_logprobs_T=separate.old_logprobs_T - 0.3 * on_policy.loss_mask_T)
    g_stale, _ = _grads(policy, stale, cfg)
    assert max(float((a - b).abs().max()) for a, b in zip(g_own, g_stale)) > 1e-4


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_a_copy_lesson_in_the_pack_adds_its_log_likelihood_gradient_at_the_coefficient(policy, tis_cap):
    """``loss.copy_lesson_coef``: a lesson packed beside rollouts, its coefficient as the advantage, adds
    coef x the gradient of its log-likelihood (what the warm start trains), and the step stays a
    mean over all loss tokens. Nothing sampled it: no importance weight (its generator logprobs are
    0, so a weight would shrink it) and no share in the logprob mismatch."""
    coef = 0.5
    g = torch.Generator().manual_seed(3)
    lesson = traj(ids=torch.randint(1, VOCAB, (14,), generator=g).tolist(), mask=[0] * 6 + [1] * 8)
    lesson.advantage, lesson.meta["lesson"] = coef, True
    cfg = loss_cfg(tis_cap=tis_cap)
    g_mix, m_mix = _grads(policy, _batch(policy, extra=[lesson]), cfg)
    rollouts = _batch(policy)
    g_roll, m_roll = _grads(policy, rollouts, cfg)
    (alone,) = pack([lesson], capacity=128)
    forward_backward(policy, [alone], warm_start_loss_fn)
    g_nll = [p.main_grad.clone() for p in policy.model.parameters()]
    n_roll, n_les = float(rollouts.loss_mask_T.sum()), float(alone.loss_mask_T.sum())
    expected = [(n_roll * a + coef * n_les * b) / (n_roll + n_les) for a, b in zip(g_roll, g_nll)]
    # the mixed pack and the two alone are other attention tiles: on CUDA the Triton kernel's tf32 dots round
    # them differently
    tol = 1e-6 if policy.device.type == "cpu" else 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(g_mix, expected)) < tol
    assert max(float((a - b).abs().max()) for a, b in zip(g_mix, g_roll)) > 1e-4  # the lesson counts
    assert float(m_mix["rollout/logprob_mismatch"]) == pytest.approx(float(m_roll["rollout/logprob_mismatch"]))


def test_reset_optimizer_state_makes_the_next_step_a_first_adam_step(policy):
    """Adam's first step moves every weight by lr * sign(grad); moments left by earlier (larger)
    gradients make the step smaller. After the reset the first-step rule holds again."""
    lr, batch = 1e-3, _batch(policy)
    set_lr(policy.optimizer, lr)
    for _ in range(3):  # warm-start-like steps leave moments behind
        with torch.no_grad():
            batch.advantages_T.mul_(-1.0)
        train_step(policy, [batch], grpo_loss_fn(loss_cfg()))

    def step_moves():
        before = {k: v.clone() for k, v in model_state(policy.module).items()}
        forward_backward(policy, [batch], grpo_loss_fn(loss_cfg()))
        grads = {n: p.main_grad.clone() for n, p in policy.module.named_parameters()}
        with cuda_type_names():
            policy.optimizer.step()
        after = model_state(policy.module)
        return {k: (after[k] - before[k], grads[k]) for k in grads if k in after}

    stale = step_moves()
    reset_optimizer_state(policy.optimizer)
    fresh = step_moves()
    for name, (delta, grad) in fresh.items():
        big = grad.abs() > 1e-4  # Adam's eps (1e-8) is negligible there
        if big.any():
            assert torch.allclose(delta[big], -lr * grad[big].sign(), rtol=1e-3, atol=1e-9), name
    ratio = [float(d[g.abs() > 1e-4].abs().mean() / lr) for d, g in stale.values() if (g.abs() > 1e-4).any()]
    assert min(ratio) < 0.9  # without the reset the steps were smaller than lr


def _weights(policy):
    return {k: v.detach().clone() for k, v in model_state(policy.module).items()}


def _restore(policy, weights):
    with torch.no_grad():
        for k, v in model_state(policy.module).items():
            v.copy_(weights[k])
    reset_optimizer_state(policy.optimizer)


def _minibatches(policy, n):
    """Eight trajectories of one prompt: four generations with advantages +1, -1, +1, -1, each sampled
    twice, so that the two halves of the batch (the two minibatches at n=2) hold the same
    generations; packed by ``minibatch_packs``, reference logprobs filled."""
    from nemo_orchestra.train.step import minibatch_packs

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, VOCAB, (6,), generator=g).tolist()
    gens = [torch.randint(1, VOCAB, (10,), generator=g).tolist() for _ in range(4)]
    trajs = []
    for k in range(8):
        t = traj(ids=prompt + gens[k % 4], mask=[0] * 6 + [1] * 10)
        t.advantage = 1.0 if k % 2 == 0 else -1.0
        t.gen_logprobs = [0.0] * 16
        trajs.append(t)
    minibatches = minibatch_packs(trajs, n, load_config(TINY).parallel)
    packs = [b for mb in minibatches for b in mb]
    for b, r in zip(packs, reference_logprobs(policy, packs)):
        b.ref_logprobs_T = r
    return minibatches


def test_one_minibatch_is_todays_on_policy_update(policy):
    """loss.minibatches=1: one optimizer step, old logprobs from its own forward (ratio 1, clip never
    binds), exactly the update train_step(grpo_loss_fn) makes on the step's packs."""
    from nemo_orchestra.train.step import grpo_update

    set_lr(policy.optimizer, 1e-2)
    start = _weights(policy)
    _restore(policy, start)  # fresh Adam moments for both updates
    cfg = loss_cfg(minibatches=1)
    (packs,) = _minibatches(policy, 1)
    m = grpo_update(policy, [packs], cfg, step=1)
    after_update = _weights(policy)
    _restore(policy, start)
    train_step(policy, _minibatches(policy, 1)[0], grpo_loss_fn(cfg))
    after_step = _weights(policy)
    _restore(policy, start)
    assert m["train/optimizer_steps"] == 1 and m["loss/clip_frac"] == 0.0
    assert all(p.old_logprobs_T is None for p in packs)  # no separate old-logprob pass
    assert all(torch.equal(after_update[k], after_step[k]) for k in start)
    assert any(not torch.equal(after_update[k], start[k]) for k in start)


def test_two_minibatches_take_two_steps_and_the_clip_binds(policy):
    """loss.minibatches=2: old logprobs from a forward before the first step; the second step sees a
    policy the first moved towards the same generations' advantages, so ratios leave
    [1 - clip_low, 1 + clip_high] in the advantage's direction and are clipped."""
    from nemo_orchestra.train.step import grpo_update

    set_lr(policy.optimizer, 5e-2)
    start = _weights(policy)
    _restore(policy, start)
    minibatches = _minibatches(policy, 2)
    assert len(minibatches) == 2
    before = forward_logprobs(policy.model, [b for mb in minibatches for b in mb], policy.device)
    m = grpo_update(policy, minibatches, loss_cfg(minibatches=2), step=1)
    _restore(policy, start)
    assert m["train/optimizer_steps"] == 2
    packs = [b for mb in minibatches for b in mb]
    for b, lp in zip(packs, before):  # the sampling policy's, on the loss's tokens (0 elsewhere)
        mask = b.loss_mask_T > 0
        torch.testing.assert_close(b.old_logprobs_T[mask], lp[mask], atol=1e-5, rtol=1e-5)
        assert torch.all(b.old_logprobs_T[~mask] == 0)
    assert m["loss/clip_frac"] > 0.0
    assert m["train/loss_tokens"] == pytest.approx(float(sum(b.loss_mask_T.sum() for b in packs)))


def test_no_kl_term_needs_no_reference_logprobs(policy):
    """kl_coef=0: the loss ignores ref_logprobs_T, so the trainer may skip the reference forward."""
    cfg = loss_cfg(kl_coef=0.0)
    filled = _batch(policy)
    unfilled = dataclasses.replace(filled, ref_logprobs_T=torch.full_like(filled.ref_logprobs_T, float("nan")))
    g_filled, m_filled = _grads(policy, filled, cfg)
    g_unfilled, m_unfilled = _grads(policy, unfilled, cfg)
    assert all(torch.equal(a, b) for a, b in zip(g_filled, g_unfilled))
    assert float(m_unfilled["loss/kl"]) == 0.0 and all(torch.isfinite(a).all() for a in g_unfilled)


def _packs():
    """Six trajectories in several packs."""
    g = torch.Generator().manual_seed(1)
    trajs = []
    for k in range(6):
        n = 10 + 3 * k
        t = traj(ids=torch.randint(1, VOCAB, (n,), generator=g).tolist(), mask=[0] * 4 + [1] * (n - 4))
        t.advantage = float(k) - 2.5
        t.gen_logprobs = [0.0] * 4 + (-torch.rand(n - 4, generator=g) * 3).tolist()
        trajs.append(t)
    packs = pack(trajs, capacity=40)
    assert len(packs) >= 3
    return packs


@pytest.mark.parametrize("idle", [True, False])
def test_reference_logprobs_ahead_give_the_update_what_reference_first_gives(policy, monkeypatch, idle):
    """The reference pass on its own thread, beside the update (perf.overlap_reference): the same
    reference logprobs and gradients as computing them first; each pack's loss waits for its own (a
    slow reference pass: a loss that did not wait would find none), and the thread runs at idle
    priority when asked (the engine behind), else at normal priority."""
    cfg = loss_cfg(tis_cap=2.0, kl_coef=0.1)
    first = _packs()
    for b, r in zip(first, reference_logprobs(policy, first)):
        b.ref_logprobs_T = r
    forward_backward(policy, first, grpo_loss_fn(cfg))
    g_first = [p.main_grad.clone() for p in policy.model.parameters()]

    forward, policies = step_module.forward_logprobs, []

    def slow_reference(*args, **kwargs):
        time.sleep(0.2)
        if sys.platform == "linux":
            policies.append(os.sched_getscheduler(0))
        return forward(*args, **kwargs)

    monkeypatch.setattr(step_module, "forward_logprobs", slow_reference)
    packs = _packs()
    ahead = ReferenceAhead(policy, packs, threads=torch.get_num_threads(), idle=idle)
    assert all(b.ref_logprobs_T is None for b in packs)
    forward_backward(policy, packs, grpo_loss_fn(cfg))
    assert ahead.join() >= 0.2 * len(packs)
    assert 0.05 < ahead.waited_s < ahead.seconds  # the first pack's loss waited (time/ref_logprobs_wait_s)
    g_ahead = [p.main_grad.clone() for p in policy.model.parameters()]
    for a, b in zip(first, packs):
        assert torch.equal(a.ref_logprobs_T, b.ref_logprobs_T)
        assert b.ref_pending is None
    assert all(torch.equal(a, b) for a, b in zip(g_first, g_ahead))
    assert any(float(a.abs().max()) > 0 for a in g_ahead)
    if sys.platform == "linux":
        assert policies == [os.SCHED_IDLE if idle else os.SCHED_OTHER] * len(packs)


def test_the_reference_thread_is_idle_only_when_the_trainer_waited_for_its_rollouts(policy):
    """Trainer.reference_ahead: at normal priority while the engine keeps ahead (no wait for the step's
    rollouts), at idle priority once the trainer waited (the engine bounds the step); no thread
    without a KL term."""
    from nemo_orchestra.train.trainer import ENGINE_BEHIND_S, Trainer

    cfg = SimpleNamespace(loss=loss_cfg(tis_cap=2.0, kl_coef=0.1), rollout=SimpleNamespace(temperature=1.0))
    trainer = SimpleNamespace(plan=SimpleNamespace(overlap_reference=True), cfg=cfg, learner=policy)
    for waited, idle in ((0.0, False), (ENGINE_BEHIND_S / 2, False), (2 * ENGINE_BEHIND_S, True), (3.0, True)):
        ahead = Trainer.reference_ahead(trainer, _packs(), waited)
        ahead.join()
        assert ahead.idle is idle, waited
    trainer.plan = SimpleNamespace(overlap_reference=False)  # RunPlan: never without a reference pass
    assert Trainer.reference_ahead(trainer, _packs(), 3.0) is None


def test_a_failed_reference_pass_stops_the_update_with_its_error(policy, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("no reference")

    monkeypatch.setattr(step_module, "forward_logprobs", broken)
    packs = _packs()
    ahead = ReferenceAhead(policy, packs)
    with pytest.raises(RuntimeError, match="reference logprobs failed: no reference"):
        forward_backward(policy, packs, grpo_loss_fn(loss_cfg(kl_coef=0.1)))
    with pytest.raises(RuntimeError, match="reference logprobs failed: no reference"):
        ahead.join()


def test_a_cancelled_reference_pass_stops_after_its_pack(policy, monkeypatch):
    """A failed update cancels the thread: it ends after the pack in progress, and nothing waits."""
    forward, done = step_module.forward_logprobs, []

    def slow_reference(*args, **kwargs):
        time.sleep(0.2)
        done.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(step_module, "forward_logprobs", slow_reference)
    packs = _packs()
    ahead = ReferenceAhead(policy, packs)
    ahead.cancel()
    assert not ahead.thread.is_alive() and len(done) < len(packs)
    assert all(b.ref_pending is None for b in packs)
