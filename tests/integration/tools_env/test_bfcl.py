"""BFCL multi-turn tasks through the tool service: the checker agrees with BFCL's own, fails a wrong
call sequence naming the differing state, isolates concurrent episodes, and says which extra is missing."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import uuid

import pytest

pytest.importorskip("bfcl_eval", reason="BFCL tasks need the 'bfcl' extra")

from nemo_orchestra.evaluation.policies import Oracle
from nemo_orchestra.evaluation.harness import PolicyRun, run_all
from tools_env.client import ToolsEnvClient
from tools_env.domains.bfcl.apis import call_as_action
from tools_env.domains.bfcl.checker import end_turn, final_outcome, run_call
from tools_env.domains.bfcl.importer import read_category, to_record
from tools_env.supervisor import start_service
from tools_env.tools.base import EpisodeContext

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def base():
    """multi_turn_base: (entry, ground truth, record) of its first 40 entries."""
    return [(e, gt, to_record(e, gt, "multi_turn_base")) for e, gt in read_category("multi_turn_base")[:40]]


@pytest.fixture(scope="module")
def svc():
    with start_service({}) as handle:
        yield handle


def _ours(record, turns):
    ctx = EpisodeContext("x", record, "/nonexistent", random.Random(0))
    for calls in turns:
        for a in calls:
            run_call(ctx, a["name"], a["arguments"])
        end_turn(ctx)
    return final_outcome(ctx)[:2]


def _bfcl(entry, gt, turns):
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
        multi_turn_checker,
    )

    decoded = [
        [[f"{a['name']}({', '.join(f'{k}={v!r}' for k, v in a['arguments'].items())})" for a in calls]] if calls else []
        for calls in turns
    ]
    return multi_turn_checker(decoded, gt, entry, "multi_turn_base", f"t{uuid.uuid4().hex}")["valid"]


def _perturb(turns, rng, kind):
    turns = [list(t) for t in turns]
    k = rng.randrange(len(turns))
    if kind == "drop_call" and turns[k]:
        turns[k].pop(rng.randrange(len(turns[k])))
    elif kind == "change_arg":
        spots = [
            (i, j, key)
            for i, t in enumerate(turns)
            for j, a in enumerate(t)
            for key, v in a["arguments"].items()
            if isinstance(v, str)
        ]
        if spots:
            i, j, key = rng.choice(spots)
            call = turns[i][j]
            turns[i][j] = {"name": call["name"], "arguments": {**call["arguments"], key: "x_" + call["arguments"][key]}}
    elif kind == "repeat_call" and turns[k]:
        turns[k].append(rng.choice(turns[k]))
    elif kind == "late_call" and k + 1 < len(turns) and turns[k]:
        turns[k + 1].insert(0, turns[k].pop())
    return turns


def test_checker_agrees_with_bfcls_on_ground_truth_and_perturbed_sequences(base):
    rng, verdicts = random.Random(0), []
    for entry, gt, record in base:
        turns = [[call_as_action(c) for c in t] for t in gt]
        for kind in ("none", "drop_call", "change_arg", "repeat_call", "late_call"):
            calls = turns if kind == "none" else _perturb(turns, rng, kind)
            ours, reason = _ours(record, calls)
            assert ours == _bfcl(entry, gt, calls), (entry["id"], kind, reason)
            verdicts.append((kind, ours))
    assert all(ok for kind, ok in verdicts if kind == "none")
    assert sum(not ok for kind, ok in verdicts if kind != "none") > len(base)  # the checker can fail


def _episode_reason(svc, record, steps):
    async def go():
        client = ToolsEnvClient(svc.urls)
        try:
            ep = (await client.create_episode(record))["episode_id"]
            out = None
            for name, args in steps:
                out = await client.step(ep, name, args)
            return out
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_wrong_call_sequence_fails_naming_the_differing_state(svc, base):
    record = base[0][2].to_dict()  # turn 0: move final_report.pdf into a new document/temp
    n = len(record["meta"]["bfcl"]["turns"])
    steps = [
        ("cd", {"folder": "document"}),
        ("mkdir", {"dir_name": "tmp"}),  # the wrong folder name
        ("mv", {"source": "final_report.pdf", "destination": "tmp"}),
    ] + [("answer", {"answer": "ok"})] * n
    out = _episode_reason(svc, record, steps)
    reason = out["outcome"]["reason"]
    assert out["done"] and out["outcome"]["correct"] is False
    assert "turn 0: GorillaFileSystem state differs from the ground truth's" in reason
    assert "'tmp'" in reason and "'temp'" in reason, reason  # the differing directory entries are named
    assert f"of {n} turns failed" in reason


def test_each_user_turns_verdict_is_reported_in_order_unreached_turns_failed(svc, base):
    entry, gt, record = next((e, g, r) for e, g, r in base if len(g) >= 3 and all(g))  # every turn makes calls
    turn0 = [call_as_action(c) for c in gt[0]]
    ctx = EpisodeContext("x", record, "/nonexistent", random.Random(0))
    for a in turn0:
        run_call(ctx, a["name"], a["arguments"])
    end_turn(ctx)  # turn 0 as the ground truth does it
    end_turn(ctx)  # turn 1 without a call: failed
    correct, _, passed = final_outcome(ctx)  # the episode stops there
    assert not correct and passed == [True, False] + [False] * (len(gt) - 2)
    # through the service: the answer that ends the last user turn reports each turn's verdict
    steps = [(a["name"], a["arguments"]) for a in turn0] + [("answer", {"answer": "ok"})] * len(gt)
    out = _episode_reason(svc, record.to_dict(), steps)
    assert out["done"] and out["outcome"]["turn_passed"] == [True] + [False] * (len(gt) - 1)


def test_answer_delivers_the_next_user_turn(svc, base):
    record = base[0][2].to_dict()
    turns = record["meta"]["bfcl"]["turns"]
    out = _episode_reason(svc, record, [("answer", {"answer": "ok"})])
    assert out["done"] is False and out["observation"].endswith(turns[1]) and f"of {len(turns)}" in out["observation"]


def test_two_concurrent_episodes_of_one_entry_do_not_share_state(svc, base):
    record = base[0][2].to_dict()
    gold = record["gold_actions"]

    async def go():
        client = ToolsEnvClient(svc.urls)
        try:
            a, b = await asyncio.gather(client.create_episode(record), client.create_episode(record))
            a, b = a["episode_id"], b["episode_id"]
            for action in gold[:3]:  # a: cd document, mkdir temp, mv final_report.pdf temp
                await client.step(a, action["name"], action["arguments"])
            await client.step(b, "cd", {"folder": "document"})
            seen_by_b = await client.step(b, "ls", {})
            for action in gold[3:] + [{"name": "answer", "arguments": {"answer": "done"}}]:
                done_a = await client.step(a, action["name"], action["arguments"])
            for _ in record["meta"]["bfcl"]["turns"]:
                done_b = await client.step(b, "answer", {"answer": "done"})
            return seen_by_b, done_a, done_b
        finally:
            await client.aclose()

    seen_by_b, done_a, done_b = asyncio.run(go())
    listing = json.loads(seen_by_b["observation"])["current_directory_content"]
    assert "temp" not in listing and "final_report.pdf" in listing  # a's mkdir and mv are not b's
    assert done_a["outcome"]["correct"] is True, done_a["outcome"]["reason"]
    assert done_b["outcome"]["correct"] is False


def test_oracle_passes_entries_in_the_agent_loop_under_their_own_budgets(svc, base):
    records = [r for _, _, r in base[:8]]

    async def go():
        client = ToolsEnvClient(svc.urls)
        try:
            from nemo_orchestra.rollout.loop import LoopLimits

            run = PolicyRun(Oracle([r.to_dict() for r in records]), LoopLimits(max_turns=1, task_turns=True))
            return await run_all(client, [run], records, {"record": None}, progress=False)
        finally:
            await client.aclose()

    results = asyncio.run(go())
    assert [(r.task_id, r.correct) for r in results] == [(r.id, True) for r in records], [r.reason for r in results]
    assert all(r.ended_by == "answer" for r in results)
    assert [r.turns for r in results] == [len(r.gold_actions) + 1 for r in records]  # within each record's budget


def test_the_agent_loop_records_where_each_user_turn_ended_and_its_verdict(svc, base):
    from nemo_orchestra.rollout.loop import LoopLimits, run_episodes

    records = [r for _, _, r in base[:3]]

    async def go():
        client = ToolsEnvClient(svc.urls)
        try:
            policy = Oracle([r.to_dict() for r in records])
            limits = LoopLimits(max_turns=1, task_turns=True)
            return await run_episodes(records, policy, client, limits=limits, default_preference={"accuracy": 1.0})
        finally:
            await client.aclose()

    for t, (entry, gt, _) in zip(asyncio.run(go()), base):
        assert t.correct and t.user_turn_passed == [True] * len(gt)
        # the oracle makes each user turn's ground-truth calls, one a turn, then answers it
        ends = [sum(len(calls) + 1 for calls in gt[: u + 1]) - 1 for u in range(len(gt))]
        assert t.user_turn_ends == ends, (entry["id"], t.user_turn_ends)


_NO_BFCL = "import sys; sys.modules['bfcl_eval'] = None  # the import fails as on a machine without the extra\n"


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-c", _NO_BFCL + code, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )


def test_missing_extra_is_a_clear_error(base, tmp_path):
    record = json.dumps(base[0][2].to_dict())
    code = f"""
import asyncio, json
from tools_env.service_config import ServiceConfig
from tools_env.episodes import EpisodeStore, ServiceError
from tools_env.prometheus import Metrics
from tools_env.server import build_tools
async def go():
    cfg = ServiceConfig.from_dict({{}})
    store = EpisodeStore(cfg, build_tools(cfg), Metrics())
    try:
        store.create(json.loads({record!r}))
    except ServiceError as e:
        print(e.code, e.message)
    await store.close()
asyncio.run(go())
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(
        "unknown_verifier verifier type 'bfcl' is unavailable: BFCL tasks need the bfcl-eval package"
    )
    assert "'bfcl' extra" in out.stdout
    main = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path('recipes/import_bfcl.py', run_name='__main__')"
    recipe = _run(main, "recipes/import_bfcl.py", f"output={tmp_path}")
    assert recipe.returncode == 2 and "'bfcl' extra" in recipe.stderr and "Traceback" not in recipe.stderr


def _mutable_ids(obj, seen=None) -> set:
    """ids of every dict, list, set and object reachable from ``obj``."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return seen
    if isinstance(obj, (dict, list, set, tuple)) or hasattr(obj, "__dict__"):
        if not isinstance(obj, tuple):
            seen.add(id(obj))
        values = obj.values() if isinstance(obj, dict) else vars(obj).values() if hasattr(obj, "__dict__") else obj
        for v in values:
            _mutable_ids(v, seen)
    return seen


def test_two_episodes_instances_share_no_mutable_object():
    """Long-context scenarios load module-level records (TravelAPI's extra credit cards); no two episodes,
    and not the policy and the ground truth of one, may hold the same object."""
    from tools_env.domains.bfcl.apis import CLASSES, new_instances

    entries = [e for e, _ in read_category("multi_turn_long_context")]
    for cls in CLASSES:
        entry = next(e for e in entries if cls in e["involved_classes"])
        a, b = (new_instances([cls], entry["initial_config"], True)[cls] for _ in range(2))
        shared = (_mutable_ids(vars(a)) & _mutable_ids(vars(b))) - {id(v) for v in vars(type(a)).values()}
        assert not shared, (cls, len(shared))
