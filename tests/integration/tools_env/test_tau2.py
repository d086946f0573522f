"""tau2-bench's domains through the tool service: the oracle passes tau2's own evaluator, doing nothing
or a wrong action fails where the database decides, and the service's verdict is what tau2's evaluator
returns on the same conversation.

Episodes run in an in-process ``EpisodeStore`` (the service's own store and tools) so the test can read
the conversation the store kept; one test goes through a service subprocess over HTTP."""

import asyncio
import json
import random
import subprocess
import sys
import time

import pytest

pytest.importorskip("tau2", reason="tau2 tasks need the 'tau2' extra")

from tools_env.domains.tau2.episode import environment, parse_task  # noqa: E402
from tools_env.domains.tau2.importer import read_tasks, to_record  # noqa: E402
from tools_env.domains.tau2.package import require_tau2  # noqa: E402
from tools_env.domains.tau2.tools import service_name  # noqa: E402
from tools_env.episodes import EpisodeStore  # noqa: E402
from tools_env.prometheus import Metrics  # noqa: E402
from tools_env.server import build_tools  # noqa: E402
from tools_env.service_config import ServiceConfig  # noqa: E402

# a slice of each domain's test split (telecom: its small set, whole); every task of every split is
# checked by scripts/tau2_oracle.py (docs/results/*_tau2-oracle.md)
SETS = [("airline", "test", 5), ("retail", "test", 8), ("telecom", "small", 20)]


def records(domain, split, limit=0):
    env = environment(domain)
    tools = [service_name(domain, t.name) for t in env.get_tools()]
    tasks = read_tasks(domain, split)
    return [to_record(t, domain, split, env.get_policy(), tools) for t in tasks[: limit or None]]


@pytest.fixture(scope="module")
def store():
    cfg = ServiceConfig.from_dict({"user": "replay", "guards": {"max_turns": 200}})
    return EpisodeStore(cfg, build_tools(cfg), Metrics())


def play(store, record, actions):
    """Create an episode and make ``actions``; the final step response and the episode's tau2 state."""

    async def run():
        ep, _ = store.create(record.to_dict())
        out = {"done": False}
        for a in actions:
            out = await store.step(ep.id, a["name"], a["arguments"])
            if out["done"]:
                break
        return out, ep.ctx

    return asyncio.run(run())


def direct_reward(ctx):
    """tau2's evaluate_simulation called here on the messages the episode kept."""
    ev = require_tau2("tau2.evaluator.evaluator")
    sim = require_tau2("tau2.data_model.simulation")
    state = ctx.state["tau2"]
    run = sim.SimulationRun(
        id="direct",
        task_id=state.task.id,
        timestamp="t",
        start_time="t",
        end_time="t",
        duration=0.0,
        termination_reason=state.termination or "max_steps",
        messages=state.messages,
    )
    task = parse_task(ctx.task.meta["tau2"])
    return ev.evaluate_simulation(run, task, ev.EvaluationType.ALL, False, state.domain).reward


def gold_changes_db(domain, task):
    """Whether the task's agent-side gold actions leave the domain's databases other than they start."""
    env = environment(domain)
    init = task.initial_state
    env.set_state(init.initialization_data if init else None, init.initialization_actions if init else None, [])
    before = (env.get_db_hash(), env.get_user_db_hash())
    for a in (task.evaluation_criteria.actions or []) if task.evaluation_criteria else []:
        if a.requestor != "assistant":
            continue
        try:
            env.make_tool_call(a.name, requestor=a.requestor, **a.arguments)
        except Exception:
            pass
    return (env.get_db_hash(), env.get_user_db_hash()) != before


@pytest.mark.parametrize("domain,split,limit", SETS)
def test_the_oracle_passes_taus_evaluator_and_the_verdict_is_taus(store, domain, split, limit):
    recs = records(domain, split, limit)
    passed, failed = 0, []
    for r in recs:
        out, ctx = play(store, r, r.gold_actions)
        assert out["done"] and ctx.state["tau2"].termination == "user_stop", (r.id, out)
        assert out["outcome"]["correct"] == (direct_reward(ctx) >= 1.0), r.id
        if out["outcome"]["correct"]:
            passed += 1
        else:
            failed.append((r.id, out["outcome"]["reason"]))
    assert passed >= 0.99 * len(recs), failed


@pytest.mark.parametrize("domain,split,limit", SETS)
def test_doing_nothing_fails_where_the_agents_gold_actions_change_the_database(store, domain, split, limit):
    """The agent only greets and signs off (the replay user still does its own part)."""
    for r in records(domain, split, limit):
        greet, said = r.gold_actions[0], r.gold_actions[-1]
        out, ctx = play(store, r, [greet, *[said] * 10])  # until the user stops
        assert out["done"], r.id
        changes = gold_changes_db(domain, parse_task(r.meta["tau2"]))
        if changes:
            assert not out["outcome"]["correct"], (r.id, out["outcome"])
        assert out["outcome"]["correct"] == (direct_reward(ctx) >= 1.0), r.id


def test_one_wrong_action_fails_and_random_calls_get_taus_verdict(store):
    rng = random.Random(0)
    recs = [r for r in records("retail", "test", 8) if len(r.gold_actions) > 3][:3]
    for r in recs:
        actions = [dict(a, arguments=dict(a["arguments"])) for a in r.gold_actions]
        writes = [i for i, a in enumerate(actions) if a["name"] != "answer" and "get_" not in a["name"]]
        if writes:  # the last write on another item of the same order, or not made at all
            del actions[writes[-1]]
            out, ctx = play(store, r, actions)
            if gold_changes_db("retail", parse_task(r.meta["tau2"])):
                assert not out["outcome"]["correct"], r.id
            assert out["outcome"]["correct"] == (direct_reward(ctx) >= 1.0), r.id
        tools = [t for t in r.tools if t.startswith("retail_")]
        noise = [{"name": rng.choice(tools), "arguments": {}} for _ in range(3)]
        out, ctx = play(store, r, [r.gold_actions[0], *noise, *r.gold_actions[1:]])
        assert out["done"] and out["outcome"]["correct"] == (direct_reward(ctx) >= 1.0), r.id


def test_a_conversation_needs_a_user_and_the_error_says_how():
    from tools_env.episodes import ServiceError

    cfg = ServiceConfig.from_dict({})  # a service that names no user
    store = EpisodeStore(cfg, build_tools(cfg), Metrics())
    with pytest.raises(ServiceError, match="need a simulated user: set the service config's 'user'") as e:
        store.create(records("airline", "test", 1)[0].to_dict())
    assert e.value.status == 400 and e.value.code == "no_user"
    with pytest.raises(ValueError, match="config 'user' is missing 'base_url'"):
        ServiceConfig.from_dict({"user": {"model": "m"}})


def test_an_endpoint_user_speaks_through_taus_simulator_and_its_totals_are_the_users(fake_openai):
    """tau2's UserSimulator over an OpenAI-compatible endpoint (the fake server's ``slowecho``, which takes
    ``SLOW_S`` to answer): the user's reply is the answer call's observation, and its price, tokens and
    time are in the episode's ``user`` totals, never in the policy's cost or latency."""
    from tests.doubles.expert_chat_server import SLOW_S

    cfg = ServiceConfig.from_dict(
        {
            "user": {"base_url": fake_openai, "model": "slowecho", "price_in": 1.0, "price_out": 2.0},
            "guards": {"max_turns": 20},
        }
    )
    endpoint_store = EpisodeStore(cfg, build_tools(cfg), Metrics())
    record = records("retail", "test", 1)[0]

    async def run():
        ep, _ = endpoint_store.create(record.to_dict())
        first = await endpoint_store.step(ep.id, "answer", {"answer": "Hi! How can I help you today?"})
        user_before = endpoint_store.lookup(ep.id)["user"]["latency_s"]
        t0 = time.perf_counter()
        second = await endpoint_store.step(ep.id, "answer", {"answer": "Could you give me your order id?"})
        wall = time.perf_counter() - t0
        summary = endpoint_store.lookup(ep.id)
        return first, second, summary, wall, summary["user"]["latency_s"] - user_before

    first, second, summary, wall, user_s = asyncio.run(run())
    assert not first["done"] and "echo:" in first["observation"], first  # the user model's own words
    assert "echo:" in second["observation"] and "order id" in second["observation"], second
    user = summary["user"]
    assert user["tokens_in"] == 2 * 11 and user["tokens_out"] == 2 * 7, user  # the fake's usage, per reply
    assert user["cost"] == pytest.approx(2 * (11 * 1.0 + 7 * 2.0) / 1e6) and user["latency_s"] > 0
    assert summary["total_cost"] == 0.0 and first["cost"] == second["cost"] == 0.0  # not the policy's
    # the user's time is the user's: at least the endpoint's, and none of it in the answer call's latency
    assert user_s >= SLOW_S and 0 <= second["latency_s"] <= wall - user_s + 0.005, (wall, user_s, second)


def test_import_tau2_writes_each_split_and_the_service_runs_it(tmp_path):
    from tools_env.supervisor import start_service
    from tools_env.task import load_jsonl
    from tools_env_helpers import http

    out = subprocess.run(
        [sys.executable, "recipes/import_tau2.py", f"output={tmp_path}", "splits=[train,test]", "domains=[airline]"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["counts"]["by_domain_split"] == {"airline/train": 30, "airline/test": 20}
    test = load_jsonl(str(tmp_path / "airline_test.jsonl"))
    assert [r.meta["tau2"]["task"]["id"] for r in test] == [t.id for t in read_tasks("airline", "test")]
    for split in ("train", "test"):  # a run's data.train_path / eval_path: every domain's records of the split
        both = (tmp_path / f"{split}.jsonl").read_text()
        assert both == (tmp_path / f"airline_{split}.jsonl").read_text() and f"{split}.jsonl" in manifest["files"]
    bad = subprocess.run(
        [sys.executable, "recipes/import_tau2.py", f"output={tmp_path}", "domains=[banking]"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "domains: unknown ['banking']" in bad.stderr, bad.stderr
    r = test[0]
    with start_service({"user": "replay"}, workers=1) as svc:
        headers = {"Authorization": f"Bearer {svc.token}"} if svc.token else None
        status, ep = http(f"{svc.urls[0]}/v1/episodes", "POST", r.to_dict(), headers=headers)
        assert status == 200, ep
        for a in r.gold_actions:
            url = f"{svc.urls[0]}/v1/episodes/{ep['episode_id']}/step"
            status, body = http(url, "POST", a, headers=headers, timeout=60)
            assert status == 200, body
        assert body["done"] and body["outcome"]["correct"], body


def test_evaluate_reports_pass_hat_k_per_domain_on_tau2_tasks(tmp_path):
    """recipes/evaluate.py on tau2 records with the replay user: the oracle's pass^k is 1 for every k."""
    out = subprocess.run(
        [
            sys.executable,
            "recipes/import_tau2.py",
            f"output={tmp_path / 'data'}",
            "domains=[telecom]",
            "splits=[small]",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (tmp_path / "service.json").write_text(json.dumps({"user": "replay"}))
    run = subprocess.run(
        [
            sys.executable,
            "recipes/evaluate.py",
            f"tasks={tmp_path / 'data' / 'telecom_small.jsonl'}",
            f"output={tmp_path / 'eval'}",
            "policies=oracle,random",
            "samples=2",
            "limit=6",
            f"tools_env.config={tmp_path / 'service.json'}",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "eval" / "results.json").read_text())
    rows = {r["policy"]: r for r in result["rows"]}
    assert rows["oracle"]["accuracy"] == 1.0 and rows["oracle"]["pass_hat_k"] == {"1": 1.0, "2": 1.0}
    assert set(rows["random"]["pass_hat_k"]) == {"1", "2"}
    assert rows["random"]["pass_hat_k"]["2"] <= rows["random"]["pass_hat_k"]["1"]
    assert result["pass_hat_k_by_category"]["oracle|record"] == {"tau2_telecom": {"1": 1.0, "2": 1.0}}
    (telecom,) = result["rows_by_category"].values()  # one domain: its rows are the report's
    assert [{k: r[k] for k in ("policy", "n", "pass_hat_k", "mean_cost")} for r in telecom] == [
        {k: r[k] for k in ("policy", "n", "pass_hat_k", "mean_cost")} for r in result["rows"]
    ]
    assert all(r["mean_wall_s"] > 0 for r in result["rows"])  # each episode's wall time, creation to end
    from tau2.data_model.simulation import Results

    for path in (tmp_path / "eval").glob("tau2_telecom_*.json"):
        assert all(sim.duration > 0 for sim in Results.load(path).simulations), path
