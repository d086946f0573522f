"""Held-out summaries: slices per category, per preference profile and per category under each
profile, with the expert shares a preference-following policy is read from."""

import pytest

from nemo_orchestra.evaluation.heldout import breakdown
from tests.helpers import task, traj


def _t(category, profile, alias, correct=True, cost=0.0):
    t = task(category=category)
    t.meta["preference_name"] = profile
    return traj(correct=correct, cost=cost, t=t, counts={"expert": 1, alias: 1})


def test_breakdown_crosses_category_and_profile():
    trajs = [
        _t("lookup", "accuracy_first", "expert-large", cost=0.004),
        _t("lookup", "accuracy_first", "expert-large", correct=False, cost=0.004),
        _t("lookup", "cost_sensitive", "expert-small", cost=0.001),
        _t("reasoning", "cost_sensitive", "expert-medium", cost=0.002),
    ]
    out = breakdown(trajs)
    assert set(out) == {
        "all",
        "category/lookup",
        "category/reasoning",
        "preference/accuracy_first",
        "preference/cost_sensitive",
        "category/lookup/accuracy_first",
        "category/lookup/cost_sensitive",
        "category/reasoning/cost_sensitive",
    }
    acc_first = out["category/lookup/accuracy_first"]
    assert acc_first["n"] == 2 and acc_first["accuracy"] == 0.5
    assert acc_first["cost_per_correct"] == pytest.approx(0.008)
    assert acc_first["expert_share/expert-large"] == 1.0
    assert out["category/lookup/cost_sensitive"]["expert_share/expert-small"] == 1.0
    assert out["category/lookup"]["expert_share/expert-large"] == pytest.approx(2 / 3)
    assert out["preference/cost_sensitive"]["cost_mean"] == pytest.approx(0.0015)


def test_tasks_without_a_profile_get_no_profile_slices():
    out = breakdown([traj(t=task(category="lookup"))])
    assert set(out) == {"all", "category/lookup"}


def test_a_sampled_evaluation_leaves_trainings_random_draws_as_they_were():
    """An in-process engine samples from torch's generator; the held-out evaluation must not shift
    the draws of the GRPO steps after it (nor a resumed run's, which evaluates first)."""
    from types import SimpleNamespace

    import torch

    from nemo_orchestra.rollout.loop import HELDOUT_SEED
    from nemo_orchestra.train.trainer import Trainer

    calls = []

    def run(tasks, samples, temperature, seed, step):
        calls.append((samples, temperature, seed))
        torch.rand(4)  # what sampling does to the generator
        return [_t("lookup", "accuracy_first", "expert-large") for _ in range(len(tasks) * samples)]

    trainer = SimpleNamespace(
        cfg=SimpleNamespace(evaluation=SimpleNamespace(temperature=0.0)),
        step=80,
        rollouts=SimpleNamespace(episodes=SimpleNamespace(run=run)),
        generation=SimpleNamespace(spans_tensor_parallel_group=False),
    )
    tasks = [task(category="lookup") for _ in range(3)]
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    sampled = Trainer.evaluate_heldout(trainer, tasks, 8, 0.7)
    assert torch.equal(torch.rand(2), expected)
    assert calls == [(8, 0.7, HELDOUT_SEED)] and sampled["all"]["n"] == 24  # every rollout counts
    Trainer.evaluate_heldout(trainer, tasks)
    assert calls[-1] == (1, 0.0, HELDOUT_SEED)  # one rollout per task at evaluation.temperature
