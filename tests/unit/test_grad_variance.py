"""The policy-gradient variance under each credit (``train/grad_variance.py``) equals what the training
path itself gives: its mean gradient is the update's policy-gradient gradient, its variance the spread of
the update's gradients taken one group at a time; it leaves the update's gradient buffers alone."""

import copy
import dataclasses

import pytest
import torch

from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.train.grad_variance import policy_gradient_variance
from nemo_orchestra.train.packing import pack
from nemo_orchestra.train.learner import build_learner
from nemo_orchestra.train.step import forward_backward, grpo_loss_fn, reference_logprobs
from nemo_orchestra.types import TurnRecord
from tests.helpers import TINY_MODEL, loss_cfg, traj

VOCAB = 256
GROUPS, PER_GROUP = 4, 3


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(TINY_MODEL)
    init_distributed(cfg.parallel, seed=11)
    return cfg, build_learner(cfg, VOCAB, torch.device("cpu"))


def _rollouts(two_turns: bool = True, seed: int = 0):
    """GROUPS groups of PER_GROUP rollouts: a prompt, then two generated turns with an observation between;
    per-turn advantages that differ from the episode's (one turn each with ``two_turns=False``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(GROUPS):
        for i in range(PER_GROUP):
            n1, n2 = 4 + i, 3 + k
            mask = [0] * 5 + [1] * n1 + [0] * 3 + [1] * n2
            t = traj(group=k, ids=torch.randint(1, VOCAB, (len(mask),), generator=g).tolist(), mask=mask)
            t.advantage = float(torch.randn((), generator=g))
            if two_turns:
                t.turns = [TurnRecord(start=5), TurnRecord(start=5 + n1 + 3)]
                t.turn_advantages = [t.advantage, float(torch.randn((), generator=g))]
            else:
                t.turns, t.turn_advantages = [TurnRecord(start=5)], [t.advantage]
            out.append(t)
    return out


def _update_grad(policy, trajs) -> tuple[torch.Tensor, float]:
    """The update's gradient (policy-gradient term only, ratio 1) over ``trajs``, flattened, and their
    trained tokens; it is -(1/N) sum_t A_t grad log pi."""
    (batch,) = pack(trajs, capacity=4096)
    batch.ref_logprobs_T = reference_logprobs(policy, [batch])[0]
    forward_backward(policy, [batch], grpo_loss_fn(loss_cfg(kl_coef=0.0)))
    grad = torch.cat([p.main_grad.flatten().clone() for p in policy.model.parameters()])
    return grad, float(batch.loss_mask_T.sum())


def _direct(policy, trajs) -> dict[str, float]:
    """tr Var and |g|^2 from the update's own gradients, one group at a time (c_k = -grad_k N_k / Nbar)."""
    groups = sorted({t.group for t in trajs})
    per_group = [_update_grad(policy, [t for t in trajs if t.group == k]) for k in groups]
    m, tokens = len(groups), sum(n for _, n in per_group)
    c = torch.stack([-g * n / (tokens / m) for g, n in per_group])
    mean = c.mean(0)
    variance = float(((c - mean) ** 2).sum()) / (m * (m - 1))
    return {"pg_variance": variance, "pg_sq_norm": float(mean.pow(2).sum())}


def _measure(cfg, policy, trajs, credit="turn"):
    adv = dataclasses.replace(cfg.advantage, credit=credit)
    return policy_gradient_variance(policy, trajs, adv, None, cfg.parallel)


def _measured_and_views(cfg, policy):
    """The metrics of a per-turn run on ``_rollouts()``, and those rollouts under each credit."""
    trajs = _rollouts()
    episode = [dataclasses.replace(t, turn_advantages=None) for t in trajs]
    return _measure(cfg, policy, trajs), (("episode", episode), ("turn", trajs))


def test_mean_gradient_is_the_updates_policy_gradient(setup):
    got, views = _measured_and_views(*setup)
    for credit, view in views:
        grad, _ = _update_grad(setup[1], view)
        assert got[f"grad/pg_sq_norm_{credit}"] == pytest.approx(float(grad.pow(2).sum()), rel=1e-4)


def test_variance_is_the_spread_of_the_per_group_update_gradients(setup):
    got, views = _measured_and_views(*setup)
    for credit, view in views:
        want = _direct(setup[1], view)
        assert got[f"grad/pg_variance_{credit}"] == pytest.approx(want["pg_variance"], rel=1e-3)
        assert got[f"grad/pg_signal_{credit}"] == pytest.approx(want["pg_sq_norm"] - want["pg_variance"], rel=1e-3)
    # the credits' advantages differ on the second turns, and so do their variances
    assert abs(got["grad/pg_variance_turn"] / got["grad/pg_variance_episode"] - 1) > 1e-3


def test_single_turn_rollouts_have_one_variance_under_both_credits(setup):
    cfg, policy = setup
    got = _measure(cfg, policy, _rollouts(two_turns=False))
    assert got["grad/pg_variance_turn"] == pytest.approx(got["grad/pg_variance_episode"], rel=1e-6)
    assert got["grad/pg_sq_norm_turn"] == pytest.approx(got["grad/pg_sq_norm_episode"], rel=1e-6)


def test_leaves_the_rollouts_and_the_gradient_buffers_as_they_were(setup):
    cfg, policy = setup
    trajs = _rollouts()
    before = copy.deepcopy([(t.advantage, t.turn_advantages) for t in trajs])
    _update_grad(policy, trajs)
    buffers = [p.main_grad.clone() for p in policy.model.parameters()]
    _measure(cfg, policy, trajs, credit="episode")
    assert [(t.advantage, t.turn_advantages) for t in trajs] == before
    assert all(torch.equal(a, p.main_grad) for a, p in zip(buffers, policy.model.parameters()))
    assert all(p.grad is None for p in policy.model.parameters())


def test_one_group_has_no_variance_to_report(setup):
    cfg, policy = setup
    got = _measure(cfg, policy, [t for t in _rollouts() if t.group == 0])
    assert all(v != v for k, v in got.items() if k.startswith("grad/pg_variance"))  # nan: unknown, not 0


def test_needs_a_single_pipeline_stage():
    with pytest.raises(ConfigError, match="advantage.grad_variance_every"):
        load_config([*TINY_MODEL, "parallel=pp2", "advantage.grad_variance_every=5"])


def test_an_episode_runs_turn_view_baselines_on_every_rollout_as_per_turn_training_would():
    from nemo_orchestra.grpo.advantages import assign_advantages
    from nemo_orchestra.train.grad_variance import credit_views
    from tests.unit.test_turn_credit import _group

    cfg = load_config(["advantage.min_group_std=-1", "advantage.credit=episode"]).advantage
    rewards, keys = [1.0, 0.0, 0.6, 0.2], [["x", "a"], ["x", "b"], ["y", "a", "a"], ["x", "c"]]
    rollouts = _group(rewards, keys)
    trained = rollouts[:3]  # the fourth filtered out of the loss (a malformed call), still a peer
    assign_advantages(rollouts, cfg)  # the episode credit, as the run trains
    views = credit_views(trained, cfg, None, peers=rollouts)
    per_turn = _group(rewards, keys)
    assign_advantages(per_turn, dataclasses.replace(cfg, credit="turn"))
    assert [t.turn_advantages for t in views["turn"]] == [t.turn_advantages for t in per_turn[:3]]
    assert [t.turn_advantages for t in views["episode"]] == [None] * 3
    alone = credit_views(trained, cfg, None)  # without the fourth, rollout 0's second turn has another baseline
    assert alone["turn"][0].turn_advantages != views["turn"][0].turn_advantages
    # the fourth's malformed calls trained as a failure (``malformed_call_rollouts``): a copy, not a peer, that
    # trains the same under both credits
    calls = dataclasses.replace(rollouts[3], advantage=-1.0, turn_advantages=None)
    views = credit_views([*trained, calls], cfg, None, peers=rollouts)
    assert views["turn"][3] is calls and views["episode"][3].token_advantages() == calls.token_advantages()
