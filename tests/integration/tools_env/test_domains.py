"""ToolScale-style domains: determinism, gold actions, isolation, SQL safety, db-state verification."""

from __future__ import annotations

import asyncio
import random

import pytest

from tools_env.domains import DOMAINS, episode_db, replay, verify_db_state
from tools_env.domains.base import dump_state, open_copy
from tools_env.task import TaskRecord
from tools_env.tools.base import TOOL_REGISTRY, EpisodeContext
from tools_env.tools.domain import DOMAIN_TOOLS


def _ctx(workdir, task: TaskRecord) -> EpisodeContext:
    return EpisodeContext(episode_id="e", task=task, workdir=str(workdir), rng=random.Random(0))


def _task(domain="bank", gold=(), answer="", db_seed=0) -> TaskRecord:
    return TaskRecord(
        problem="p",
        answer=answer,
        category="function_calling",
        tools=[],
        domain=domain,
        gold_actions=list(gold),
        verifier={"type": "db_state", "db_seed": db_seed},
    )


def _call(name, args, ctx):
    return asyncio.run(TOOL_REGISTRY[name]().call(args, ctx))


def test_ten_domains_with_read_and_write_tools():
    assert len(DOMAINS) >= 10
    for d in DOMAINS.values():
        writes = [f for f in d.functions.values() if f.writes]
        assert writes and len(writes) < len(d.functions), d.name
        assert d.policy and d.templates
        for f in d.functions.values():
            p = f.parameters
            assert set(p["required"]) <= set(p["properties"]) and p["type"] == "object"
    assert set(DOMAIN_TOOLS) <= set(TOOL_REGISTRY)
    assert "bank_transfer" in TOOL_REGISTRY and "railway_book_ticket" in TOOL_REGISTRY


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_seeded_database_is_deterministic_and_gold_actions_replay(name):
    d = DOMAINS[name]
    assert d.build(0) == d.build(0)
    assert d.build(0) != d.build(1)
    db = open_copy(d, 0)
    rng = random.Random(0)
    made = 0
    for template in d.templates:
        for _ in range(5):
            task = template(db, rng)
            if task is None:
                continue
            made += 1
            actions = [{"name": d.tool_name(a["name"]), "arguments": a["arguments"]} for a in task.gold_actions]
            _, results = replay(d, 0, actions)
            assert not any(isinstance(r, dict) and set(r) == {"error"} for r in results), (task.scenario, results)
    assert made >= len(d.templates)


def test_episodes_write_to_private_copies(tmp_path):
    t = _task()
    a, b = _ctx(tmp_path / "a", t), _ctx(tmp_path / "b", t)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    before = _call("bank_list_cards", {"account_id": "ACC-01C"}, b)
    res = _call("bank_freeze_card", {"card_id": "CARD-01"}, a)
    assert res.error is None and '"frozen"' in res.observation
    assert _call("bank_list_cards", {"account_id": "ACC-01C"}, b).observation == before.observation
    assert "frozen" in _call("bank_list_cards", {"account_id": "ACC-01C"}, a).observation


def test_refused_write_rolls_back_and_is_an_error_observation(tmp_path):
    ctx = _ctx(tmp_path, _task())
    state = dump_state(episode_db(ctx, DOMAINS["bank"]))
    res = _call("bank_transfer", {"from_account": "ACC-01C", "to_account": "ACC-02C", "amount": 10**9}, ctx)
    assert res.error is not None and res.observation.startswith("error:")
    assert dump_state(episode_db(ctx, DOMAINS["bank"])) == state


def test_sql_is_parameterized(tmp_path):
    ctx = _ctx(tmp_path, _task())
    state = dump_state(episode_db(ctx, DOMAINS["bank"]))
    res = _call("bank_find_accounts", {"owner": "x' OR '1'='1"}, ctx)
    assert res.error is not None and "no accounts" in res.error
    res = _call("bank_freeze_card", {"card_id": "CARD-01'; DROP TABLE cards; --"}, ctx)
    assert "not found" in res.error
    assert dump_state(episode_db(ctx, DOMAINS["bank"])) == state


def test_bad_argument_types_are_errors(tmp_path):
    ctx = _ctx(tmp_path, _task(domain="railway"))
    res = _call("railway_book_ticket", {"train_id": "TR-001", "passenger": "A B", "seats": "two"}, ctx)
    assert res.error is not None and "integer" in res.error


def test_verify_db_state(tmp_path):
    gold = [{"name": "bank_freeze_card", "arguments": {"card_id": "CARD-02"}}]
    ctx = _ctx(tmp_path, _task(gold=gold))
    ok, reason = verify_db_state(ctx, ctx.task)  # nothing done yet
    assert not ok and "cards" in reason
    _call("bank_freeze_card", {"card_id": "CARD-03"}, ctx)  # the wrong card
    _call("bank_freeze_card", {"card_id": "CARD-02"}, ctx)
    assert not verify_db_state(ctx, ctx.task)[0]

    ctx2 = _ctx(tmp_path / "2", _task(gold=gold))
    (tmp_path / "2").mkdir()
    _call("bank_freeze_card", {"card_id": "CARD-02"}, ctx2)
    assert verify_db_state(ctx2, ctx2.task) == (True, "database state matches the gold actions")


def test_verify_checks_the_answer_when_one_is_expected(tmp_path):
    gold = [{"name": "bank_get_balance", "arguments": {"account_id": "ACC-01C"}}]
    _, (res,) = replay(DOMAINS["bank"], 0, gold)
    task = _task(gold=gold, answer=f"{res['balance']:.2f}")
    ctx = _ctx(tmp_path, task)
    ctx.state["final_answer"] = f"Your balance is ${res['balance']:.2f}"
    assert verify_db_state(ctx, task)[0]
    ctx.state["final_answer"] = f"{res['balance'] + 1:.2f}"
    ok, reason = verify_db_state(ctx, task)
    assert not ok and "answer" in reason


def test_database_seed_comes_from_the_record(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = _call("weather_get_week", {"city": "Aldport"}, _ctx(tmp_path / "a", _task("weather", db_seed=0)))
    b = _call("weather_get_week", {"city": "Aldport"}, _ctx(tmp_path / "b", _task("weather", db_seed=1)))
    assert a.error is None and b.error is None and a.observation != b.observation
