"""pass^k in the evaluation report equals tau2's own ``pass_hat_k`` averaged over tasks, and reads as its
definition says on hand-made cases."""

import random

import pytest

from nemo_orchestra.evaluation.harness import EpisodeResult
from nemo_orchestra.evaluation.report import pass_hat_k, pass_hat_k_by_category, rows_by_category, summarize


def result(task, correct, category="c", **kw):
    fields = dict(cost=0.0, tool_cost=0.0, policy_cost=0.0, latency_s=0.0, turns=1)
    return EpisodeResult(
        task_id=task, category=category, domain=None, policy="p", preference="record", sample=0,
        correct=correct, reason="", **{**fields, **kw},
    )  # fmt: skip


def test_pass_hat_k_by_its_definition():
    rs = [result("a", True)] * 4 + [result("b", True), result("b", False), result("b", True), result("b", False)]
    got = pass_hat_k(rs)
    assert got["1"] == pytest.approx((1 + 0.5) / 2)
    assert got["2"] == pytest.approx((1 + 1 / 6) / 2)  # C(2,2)/C(4,2) for b
    assert got["4"] == pytest.approx(0.5) and set(got) == {"1", "2", "3", "4"}
    uneven = [result("a", True)] * 3 + [result("b", False)]  # k only up to the fewest samples a task has
    assert set(pass_hat_k(uneven)) == {"1"}
    by = pass_hat_k_by_category([result("a", True, "x"), result("b", False, "y")])
    assert by == {"p|record": {"x": {"1": 1.0}, "y": {"1": 0.0}}}


def test_pass_hat_k_equals_taus_formula():
    metrics = pytest.importorskip("tau2.metrics.agent_metrics", reason="the 'tau2' extra")
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 6)
        tasks = {f"t{i}": [rng.random() < 0.6 for _ in range(n)] for i in range(rng.randint(1, 8))}
        rs = [result(t, c) for t, cs in tasks.items() for c in cs]
        got = pass_hat_k(rs)
        for k in range(1, n + 1):
            want = sum(metrics.pass_hat_k(n, sum(cs), k) for cs in tasks.values()) / len(tasks)
            assert got[str(k)] == pytest.approx(want), (k, tasks)


def test_each_category_is_reported_as_a_report_of_its_own_episodes():
    """A category's rows (a tau2 domain's pass^k, cost, latency, wall time) are the rows of its episodes
    alone; the means are per episode."""
    rng = random.Random(1)
    rs = [
        result(f"{cat}{t}", rng.random() < 0.5, cat, cost=rng.random(), latency_s=rng.random(), wall_s=rng.random())
        for cat in ("airline", "retail")
        for t in range(5)
        for _ in range(2)
    ]
    by = rows_by_category(rs)
    assert list(by) == ["airline", "retail"]
    for cat, rows in by.items():
        own = [r for r in rs if r.category == cat]
        assert [r.__dict__ for r in rows] == [r.__dict__ for r in summarize(own)]
        assert rows[0].n == 10 and set(rows[0].pass_hat_k) == {"1", "2"}
        assert rows[0].mean_wall_s == pytest.approx(sum(r.wall_s for r in own) / 10)
        assert rows[0].mean_cost == pytest.approx(sum(r.cost for r in own) / 10)
    (overall,) = summarize(rs)
    assert overall.mean_wall_s == pytest.approx(sum(r.wall_s for r in rs) / 20)
