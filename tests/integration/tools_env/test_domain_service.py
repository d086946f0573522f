"""Synthesized records through the real tool service: every gold answer verifies; domain DBs are isolated."""

from __future__ import annotations

import asyncio
import os

import pytest

from nemo_orchestra.evaluation.policies import Oracle
from nemo_orchestra.evaluation.harness import PolicyRun, run_all
from nemo_orchestra.synth.pipeline import SynthConfig, synthesize
from tools_env.client import ToolsEnvClient
from tools_env.supervisor import start_service
from tools_env.task import load_jsonl


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("synth"))
    synthesize(SynthConfig(output=out, seed=5, num_tasks=120, eval_fraction=0.2, db_seeds=3, progress=False))
    return out


@pytest.fixture(scope="module")
def svc(data):
    with start_service({"tools": {"search": {"corpus": os.path.join(data, "corpus")}}}) as handle:
        yield handle


def test_every_gold_answer_verifies_in_the_service(data, svc):
    records = [r for name in ("train.jsonl", "eval.jsonl") for r in load_jsonl(os.path.join(data, name))]
    assert {r.category for r in records} == {"arithmetic", "lookup", "reasoning", "function_calling"}

    async def go():
        client = ToolsEnvClient(svc.urls)
        try:
            oracle = PolicyRun(Oracle([r.to_dict() for r in records]))
            return await run_all(client, [oracle], records, {"record": None}, progress=False)
        finally:
            await client.aclose()

    results = asyncio.run(go())
    wrong = [(r.task_id, r.reason) for r in results if not r.correct]
    assert not wrong, wrong[:5]
    writes = [r for r in results if r.domain and r.tool_counts]
    assert writes and all(r.ended_by == "answer" for r in results)


def _bank_task(gold):
    return {
        "problem": "freeze my card",
        "answer": "",
        "category": "function_calling",
        "domain": "bank",
        "tools": ["bank_freeze_card", "bank_list_cards", "answer"],
        "gold_actions": gold,
        "verifier": {"type": "db_state", "db_seed": 0},
    }


def test_concurrent_episodes_do_not_see_each_others_writes(svc):
    gold = [{"name": "bank_freeze_card", "arguments": {"card_id": "CARD-01"}}]

    async def go():
        client = ToolsEnvClient(svc.urls)
        try:
            a, b = await asyncio.gather(
                client.create_episode(_bank_task(gold)), client.create_episode(_bank_task(gold))
            )
            a, b = a["episode_id"], b["episode_id"]
            await client.step(a, "bank_freeze_card", {"card_id": "CARD-01"})
            seen_by_b = await client.step(b, "bank_list_cards", {"account_id": "ACC-01C"})
            done_a = await client.step(a, "answer", {"answer": "done"})
            done_b = await client.step(b, "answer", {"answer": "done"})  # b never froze the card
            return seen_by_b, done_a, done_b
        finally:
            await client.aclose()

    seen_by_b, done_a, done_b = asyncio.run(go())
    assert '"active"' in seen_by_b["observation"]
    assert done_a["outcome"]["correct"] is True
    assert done_b["outcome"]["correct"] is False and "cards" in done_b["outcome"]["reason"]
