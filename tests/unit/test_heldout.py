"""Held-out summaries: slices per category, per preference profile and per category under each
profile, with the expert shares a preference-following policy is read from."""

import pytest

from nemo_orchestra.evaluation.heldout import breakdown
from tests.unit.helpers import task, traj


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
