import pytest

from nemo_orchestra.grpo.reward import assign_rewards, group_rewards
from tests.helpers import reward_cfg, task, traj


def test_incorrect_rollouts_earn_zero():
    g = [traj(correct=False, cost=0.0), traj(correct=True, cost=1.0)]
    assert group_rewards(g, reward_cfg())[0] == 0.0


def test_cost_and_latency_are_penalties():
    # Two correct rollouts; the second is more expensive and slower: it must earn less.
    t = task({"accuracy": 1.0, "cost": 1.0, "latency": 1.0})
    g = [traj(cost=0.01, latency=1.0, t=t), traj(cost=0.05, latency=9.0, t=t)]
    cheap, dear = group_rewards(g, reward_cfg())
    assert cheap > dear
    # hand-computed: weights sum 3; cheap gets (1 + 1 + 1)/3, dear gets (1 + 0 + 0)/3
    assert cheap == pytest.approx(1.0)
    assert dear == pytest.approx(1 / 3)


@pytest.mark.parametrize("normalize", ["minmax", "max"])
def test_latencies_below_the_resolution_earn_the_same(normalize):
    """A calculator and an answer take 25-340 us, the machine's noise: rollouts that did the same earn
    the same; latencies a millisecond or more apart still differ, the faster earning more."""
    t = task({"accuracy": 1.0, "cost": 0.0, "latency": 1.0})
    local = [traj(latency=s, t=t) for s in (339e-6, 84e-6, 43e-6, 27e-6)]
    assert len(set(group_rewards(local, reward_cfg(normalize=normalize)))) == 1
    as_measured = group_rewards(local, reward_cfg(normalize=normalize, latency_resolution_s=0.0))
    assert max(as_measured) - min(as_measured) > 0.3  # what the noise was worth before
    experts = [traj(latency=s, t=t) for s in (1.2004, 1.2001, 1.6)]
    slow_a, slow_b, slower = group_rewards(experts, reward_cfg(normalize=normalize))
    assert slow_a == slow_b > slower


def test_latencies_are_rounded_call_by_call():
    """An expert's drawn 1.2349 s and a calculator's 30 or 340 us: the same rounded per call, though
    their sums fall either side of a rounding boundary (1.235 s)."""
    t = task({"accuracy": 1.0, "cost": 0.0, "latency": 1.0})
    calls = [[1.2349, 30e-6], [1.2349, 340e-6], [1.7, 30e-6]]
    group = [traj(latency=sum(c), t=t) for c in calls]
    for tr, c in zip(group, calls):
        tr.call_latencies_s = c
    a, b, slower = group_rewards(group, reward_cfg(normalize="max"))
    assert a == b > slower
    for tr in group:  # the totals as one call each, rounded: 1.23 against 1.24
        tr.call_latencies_s = [tr.latency_s]
    a, b, _ = group_rewards(group, reward_cfg(normalize="max"))
    assert a != b


def test_a_latency_without_its_calls_is_refused():
    t = task({"accuracy": 1.0, "cost": 0.0, "latency": 1.0})
    group = [traj(latency=1.2, t=t), traj(latency=1.5, t=t)]
    group[1].call_latencies_s = []
    with pytest.raises(ValueError, match="reports 1.5 s of tool latency but no call's"):
        group_rewards(group, reward_cfg())
    assert len(set(group_rewards(group, reward_cfg(latency_resolution_s=0.0)))) == 2  # the totals, as asked


def test_latency_resolution_must_not_be_negative():
    cfg = reward_cfg(latency_resolution_s=-0.001)
    with pytest.raises(ValueError, match="reward.latency_resolution_s"):
        cfg.validate()


def test_cost_weight_zero_ignores_cost():
    t = task({"accuracy": 1.0, "cost": 0.0, "latency": 0.0})
    g = [traj(cost=0.01, t=t), traj(cost=0.05, t=t)]
    assert group_rewards(g, reward_cfg()) == [1.0, 1.0]


def test_equal_costs_give_full_efficiency_credit():
    t = task({"accuracy": 1.0, "cost": 1.0, "latency": 0.0})
    g = [traj(cost=0.02, t=t), traj(cost=0.02, t=t), traj(correct=False, cost=0.02, t=t)]
    assert group_rewards(g, reward_cfg()) == [1.0, 1.0, 0.0]


def test_outcome_only_ablation():
    g = [traj(correct=True, cost=5.0), traj(correct=False)]
    assert group_rewards(g, reward_cfg("outcome_only", efficiency=False, preference=False)) == [1.0, 0.0]


def test_task_preference_versus_config_default():
    t = task({"accuracy": 1.0, "cost": 0.0, "latency": 0.0})
    g = [traj(cost=0.0, t=t), traj(cost=1.0, t=t)]
    assert group_rewards(g, reward_cfg()) == [1.0, 1.0]  # task says cost does not matter
    eff = reward_cfg("outcome_efficiency", preference=False, accuracy=1.0, cost=1.0)
    assert group_rewards(g, eff) == [1.0, 0.5]  # config weights apply to every task


def test_tool_preference_rewards_preferred_tool_use():
    t = task({"accuracy": 1.0, "tools": {"expert-small": 1.0}})
    g = [traj(t=t, counts={"expert-small": 1}), traj(t=t, counts={"expert-large": 1})]
    r = group_rewards(g, reward_cfg())
    assert r[0] == pytest.approx(1.0) and r[1] == pytest.approx(0.5)


def test_chebyshev_is_limited_by_worst_weighted_objective():
    t = task({"accuracy": 1.0, "cost": 1.0, "latency": 0.5})
    g = [traj(cost=0.0, latency=10.0, t=t), traj(cost=1.0, latency=0.0, t=t)]
    r = group_rewards(g, reward_cfg(scalarization="chebyshev"))
    # first: worst term is latency 0.5 * (1 - 0) = 0.5 -> 0.5; second: cost 1.0 * 1 -> 0.0
    assert r == pytest.approx([0.5, 0.0])


def test_assign_rewards_normalizes_within_each_group_only():
    t = task({"accuracy": 1.0, "cost": 1.0})
    trajs = [traj(cost=1.0, group=0, t=t), traj(cost=2.0, group=0, t=t), traj(cost=100.0, group=1, t=t)]
    assign_rewards(trajs, reward_cfg())
    assert [x.reward for x in trajs] == pytest.approx([1.0, 0.5, 1.0])


def _std(xs):
    m = sum(xs) / len(xs)
    return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5


def test_max_normalization_keeps_jitter_small_and_choices_apart():
    """A group that made one choice throughout (the same expert: latency drawn from its 1-2 s range,
    costs a few percent apart): min-max stretches the jitter to a reward spread above the paper's
    0.1 std filter, max-normalization keeps it under. Between a cheap and a dear expert both give
    nearly the same gap."""
    t = task({"accuracy": 1.0, "cost": 1.0, "latency": 0.5})
    same = [traj(cost=c, latency=lat, t=t) for c, lat in ((4.0e-5, 1.0), (4.1e-5, 1.9), (4.2e-5, 1.4), (4.05e-5, 1.6))]
    assert _std(group_rewards(same, reward_cfg())) > 0.1
    assert _std(group_rewards(same, reward_cfg(normalize="max"))) < 0.05
    mixed = [traj(cost=4.0e-5, latency=1.5, t=t), traj(cost=5.0e-3, latency=9.0, t=t)]
    (a, b), (c, d) = group_rewards(mixed, reward_cfg()), group_rewards(mixed, reward_cfg(normalize="max"))
    assert a == pytest.approx(1.0) and c == pytest.approx(1.0)
    assert b == pytest.approx(0.4) and d == pytest.approx(0.4 + 0.2 * 1.5 / 9.0 + 0.4 * 4e-5 / 5e-3)


@pytest.mark.parametrize("scalarization", ["linear", "chebyshev"])
@pytest.mark.parametrize("normalize", ["minmax", "max"])
def test_group_value_gives_each_rollout_its_own_reward(scalarization, normalize):
    """The counterfactual per-turn credit evaluates is the reward itself on the group's own rollouts."""
    from nemo_orchestra.grpo.reward import group_value, latency_at_resolution

    cfg = reward_cfg(scalarization=scalarization, normalize=normalize, latency_resolution_s=0.01)
    t0 = task(preference={"accuracy": 1.0, "cost": 0.7, "latency": 0.3})
    group = [traj(correct=c, cost=x, latency=y, t=t0) for c, x, y in [(1, 0.2, 1.3), (1, 0.05, 0.4), (0, 0.9, 2.0)]]
    value = group_value(group, cfg)
    got = [value(t.correct, t.cost, latency_at_resolution(t.call_latencies_s, 0.01)) for t in group]
    assert got == pytest.approx(group_rewards(group, cfg))
    assert value(True, 0.01, 0.1) > value(True, 0.5, 0.1) > value(False, 0.01, 0.1) == 0.0
    tools = task(preference={"accuracy": 1.0, "tools": {"calculator": 1.0}})
    assert group_value([traj(t=tools), traj(t=tools)], reward_cfg()) is None  # counts are not kept per turn
