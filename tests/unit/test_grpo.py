import math

import pytest
import torch

from nemo_orchestra import kernels
from nemo_orchestra.grpo.advantages import assign_advantages, failure_advantage
from nemo_orchestra.grpo.loss import policy_loss
from nemo_orchestra.train.packing import first_fit_decreasing, pack
from nemo_orchestra.types import TurnRecord
from tests.helpers import adv_cfg, loss_cfg, task, traj


def test_advantages_hand_computed_and_zero_variance_groups_dropped():
    trajs = [traj(group=0), traj(group=0), traj(group=1), traj(group=1)]
    for t, r in zip(trajs, [1.0, 0.0, 0.5, 0.5]):
        t.reward = r
    kept, m = assign_advantages(trajs, adv_cfg())
    std = math.sqrt(0.5)  # sample std of {1, 0}
    assert trajs[0].advantage == pytest.approx(0.5 / (std + 1e-6))
    assert trajs[1].advantage == pytest.approx(-0.5 / (std + 1e-6))
    assert trajs[2].advantage == 0.0 and trajs[3].advantage == 0.0
    assert kept == trajs[:2]
    assert m["advantage/groups_dropped"] == 1


@pytest.mark.parametrize("mode", ["std", "mean", "loo"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_failure_advantage_is_what_the_kernel_gives_a_failed_member(mode, clip):
    rewards = [0.0, 0.9, 0.4, 0.75, 0.0, 1.0]
    adv = kernels.grouped_advantage(
        torch.tensor(rewards), group_ids=torch.zeros(6, dtype=torch.int64), mode=mode, eps=1e-6, clip=clip
    )
    assert failure_advantage(rewards, mode, 1e-6, clip) == pytest.approx(float(adv[0]), rel=1e-5)
    assert failure_advantage([0.7], mode, 1e-6, clip) == 0.0  # alone: nothing to compare with


def _broken(t, *spans):
    t.turns = [TurnRecord(key="<malformed>", start=s, broken=(s, e)) for s, e in spans]


def test_malformed_calls_are_trained_as_failures_and_nothing_else_of_their_rollout():
    """``train_malformed_calls``: a malformed rollout is trained on its malformed turns' broken spans only (their
    plans, its other turns: out), with the advantage a failed rollout of its group gets, whatever it ended with."""
    ids = list(range(12))
    trajs = [traj(group=0, ids=ids, mask=[0, 0] + [1] * 10) for _ in range(4)]
    for t, r in zip(trajs, [1.0, 0.8, 0.0, 1.0]):
        t.reward, t.stop_reason = r, "answer"
    trajs[1].format_errors = 1  # a broken call, recovered: reward 0.8
    _broken(trajs[1], (4, 7))
    trajs[2].schema_errors = 1
    _broken(trajs[2], (3, 5), (9, 12))
    kept, m = assign_advantages(trajs, adv_cfg(drop_format_errors=True, train_malformed_calls=True))
    fail = failure_advantage([1.0, 0.8, 0.0, 1.0], "std", 1e-6, 3.0)
    assert fail < 0 and fail == pytest.approx(trajs[2].advantage) and trajs[1].advantage > 0
    assert kept[0] is trajs[0] and kept[3] is trajs[3] and m["advantage/malformed_calls_trained"] == 2
    assert kept[1].loss_mask == [0] * 4 + [1] * 3 + [0] * 5 and kept[1].token_advantages() == [fail] * 12
    assert kept[2].loss_mask == [0] * 3 + [1] * 2 + [0] * 4 + [1] * 3 and kept[2].advantage == fail
    assert trajs[1].loss_mask == [0, 0] + [1] * 10 and trajs[1].advantage > 0  # the rollouts as they came back
    # per-turn credit: the malformed calls still train as a failure
    kept, _ = assign_advantages(trajs, adv_cfg(drop_format_errors=True, train_malformed_calls=True, credit="turn"))
    assert set(kept[2].token_advantages()) == {fail}
    # off: both dropped, as the paper's filter does
    kept, m = assign_advantages(trajs, adv_cfg(drop_format_errors=True))
    assert kept == [trajs[0], trajs[3]] and m["advantage/malformed_calls_trained"] == 0
    # a malformed rollout without spans (a message-based policy's) is dropped as before
    for t, r in zip(trajs, [0.0, 0.0, 0.0, 1.0]):
        t.reward = r
    trajs[1].turns = []
    kept, m = assign_advantages(trajs, adv_cfg(drop_format_errors=True, train_malformed_calls=True))
    assert [k.loss_mask for k in kept[1:2]] == [[0] * 3 + [1] * 2 + [0] * 4 + [1] * 3]
    assert len(kept) == 3 and kept[0] is trajs[0] and kept[2] is trajs[3]
    # a group where a failure is not below the mean: nothing of its malformed rollouts is trained
    for t, r in zip(trajs, [0.0, 0.0, 0.0, 0.0]):
        t.reward = r
    kept, m = assign_advantages(trajs, adv_cfg(drop_format_errors=True, train_malformed_calls=True))
    assert m["advantage/malformed_calls_trained"] == 0 and trajs[2] not in kept


def test_min_group_std_filters_low_variance_groups():
    trajs = [traj(group=0), traj(group=0)]
    trajs[0].reward, trajs[1].reward = 0.55, 0.5  # sample std 0.035
    kept, _ = assign_advantages(trajs, adv_cfg(min_group_std=0.1))
    assert kept == []


def test_malformed_rollouts_count_in_their_group_but_are_not_trained():
    """``drop_format_errors``: a rollout with a malformed or off-schema call is left out of the loss, and its reward
    still sets its group's mean and std (the paper's filter)."""
    trajs = [traj(group=0) for _ in range(4)]
    for t, r in zip(trajs, [1.0, 0.8, 0.0, 1.0]):
        t.reward, t.stop_reason = r, "answer"
    trajs[1].format_errors, trajs[2].schema_errors = 1, 1
    kept, m = assign_advantages(trajs, adv_cfg(drop_format_errors=True))
    assert kept == [trajs[0], trajs[3]] and m["advantage/dropped_format_errors"] == 2
    assert trajs[0].advantage == pytest.approx(trajs[3].advantage) and trajs[2].advantage < 0
    kept, m = assign_advantages(trajs, adv_cfg(drop_format_errors=False))
    assert kept == trajs and m["advantage/dropped_format_errors"] == 0


def test_loss_positive_advantage_at_ratio_one():
    lp = torch.log(torch.tensor([0.5, 0.25, 0.5]))
    mask = torch.tensor([1.0, 1.0, 0.0])
    adv = torch.tensor([2.0, 2.0, 2.0])
    loss, n, m = policy_loss(lp, lp.clone(), lp.clone(), adv, mask, loss_cfg())
    assert n == 2
    assert loss.item() == pytest.approx(-4.0)  # -A * 1 on two tokens, summed
    assert m["loss/clip_frac"] == 0.0


def test_loss_clips_ratio_above_one_plus_eps_high():
    old = torch.zeros(1)
    lp = torch.log(torch.tensor([2.0]))  # ratio 2
    loss, _, m = policy_loss(lp, old, old, torch.tensor([1.0]), torch.ones(1), loss_cfg())
    assert loss.item() == pytest.approx(-1.28)
    assert m["loss/clip_frac"] == 1.0


def test_dual_clip_bounds_negative_advantage_loss():
    old = torch.zeros(1)
    lp = torch.log(torch.tensor([50.0]))  # ratio 50, A = -1: unbounded PPO loss would be 50
    loss, _, _ = policy_loss(lp, old, old, torch.tensor([-1.0]), torch.ones(1), loss_cfg(dual_clip=10.0))
    assert loss.item() == pytest.approx(10.0)


def test_k3_kl_matches_hand_value_and_gradient_flows():
    lp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])
    loss, _, m = policy_loss(lp, lp.detach(), ref, torch.zeros(1), torch.ones(1), loss_cfg(kl_coef=1.0))
    d = math.log(0.25) - math.log(0.5)
    assert loss.item() == pytest.approx(math.exp(d) - d - 1)
    loss.backward()
    assert lp.grad.item() == pytest.approx(-math.exp(d) + 1)


def test_first_fit_decreasing_respects_capacity():
    bins = first_fit_decreasing([5, 4, 3, 3, 2, 9], capacity=9)
    lengths = [5, 4, 3, 3, 2, 9]
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 9 for b in bins)
    assert len(bins) == 3


def test_pack_shifts_targets_and_masks_within_sequences():
    a = traj(ids=[10, 11, 12], mask=[0, 1, 1])
    b = traj(ids=[20, 21], mask=[0, 1])
    a.advantage, b.advantage = 1.5, -0.5
    (batch,) = pack([a, b], capacity=16, pad_to_multiple=4)
    assert batch.input_ids_T.tolist() == [10, 11, 12, 20, 21, 0, 0, 0]
    assert batch.target_ids_T.tolist()[:5] == [11, 12, 0, 21, 0]
    assert batch.loss_mask_T.tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
    assert batch.position_ids_T.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert batch.cu_seqlens_B1.tolist() == [0, 3, 5, 8]
    assert batch.advantages_T.tolist()[:5] == [1.5, 1.5, 1.5, -0.5, -0.5]
    assert batch.traj_index_B == [0, 1, -1]


def test_rollout_metrics_report_expert_choice_per_preference_profile():
    from nemo_orchestra.train.step_metrics import rollout_metrics

    def profiled(name, counts):
        t = task()
        t.meta["preference_name"] = name
        return traj(t=t, counts=counts)

    m = rollout_metrics(
        [
            profiled("cost_sensitive", {"answer": 1, "expert-small": 1}),
            profiled("cost_sensitive", {"expert": 1, "answer": 1, "expert-small": 1, "expert-large": 1}),
            profiled("accuracy_first", {"answer": 1, "expert-large": 1}),
            traj(counts={"answer": 1, "expert-medium": 1}),  # no profile: in the overall shares only
        ]
    )
    assert m["rollout/expert_share/cost_sensitive/expert-small"] == pytest.approx(2 / 3)
    assert m["rollout/expert_share/cost_sensitive/expert-large"] == pytest.approx(1 / 3)
    assert m["rollout/expert_share/cost_sensitive/expert-medium"] == 0.0
    assert m["rollout/expert_share/accuracy_first/expert-large"] == 1.0
    assert not any(k.startswith("rollout/expert_share/") and "medium" in k and m[k] for k in m)


def test_rollout_filters_mask_malformed_and_unanswered_rollouts_but_keep_them_in_the_baseline():
    trajs = [traj(group=0) for _ in range(4)]
    for t, r in zip(trajs, [1.0, 0.0, 0.0, 1.0]):
        t.reward, t.stop_reason = r, "answer"
    trajs[1].format_errors = 2  # a malformed call, then an answer
    trajs[2].stop_reason = "max_turns"  # never answered
    kept, m = assign_advantages(trajs, adv_cfg())
    assert kept == trajs and m["advantage/dropped_format_errors"] == m["advantage/dropped_unanswered"] == 0
    baseline = [t.advantage for t in trajs]
    kept, m = assign_advantages(trajs, adv_cfg(drop_format_errors=True, drop_unanswered=True))
    assert kept == [trajs[0], trajs[3]]
    assert m["advantage/dropped_format_errors"] == 1 and m["advantage/dropped_unanswered"] == 1
    assert [t.advantage for t in trajs] == baseline  # the group's mean and std still include them
    kept, _ = assign_advantages(trajs, adv_cfg(drop_unanswered=True))
    assert kept == [trajs[0], trajs[1], trajs[3]]
    trajs[1].format_errors, trajs[3].schema_errors = 0, 1  # a call that parsed but did not fit its tool
    kept, m = assign_advantages(trajs, adv_cfg(drop_format_errors=True))
    assert kept == trajs[:3] and m["advantage/dropped_format_errors"] == 1
