"""The search tool: BM25 ranking, the synthetic corpus, multi-hop retrieval, argument handling."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from nemo_orchestra.synth.candidates import lookup
from tools_env.corpus import Document, build_world, load_corpus, write_corpus
from tools_env.task import TaskRecord
from tools_env.tools.base import EpisodeContext
from tools_env.tools.search import BM25Index, SearchTool


def _ctx(tmp_path) -> EpisodeContext:
    task = TaskRecord(problem="q", answer="a", category="lookup", tools=["search"])
    return EpisodeContext(episode_id="e", task=task, workdir=str(tmp_path), rng=random.Random(0))


def test_bm25_ranks_the_rarer_term_higher():
    docs = [Document("a", "", "apple apple banana"), Document("b", "", "banana cherry"), Document("c", "", "cherry")]
    index = BM25Index(docs)
    assert [d.id for d, _ in index.search("apple", 3)] == ["a"]
    # "banana" is in two docs, "cherry" in two; the doc holding both matches best
    assert index.search("banana cherry", 1)[0][0].id == "b"
    assert index.search("durian", 3) == []


def test_corpus_is_deterministic_in_its_seed(tmp_path):
    a, b, c = build_world(0), build_world(0), build_world(1)
    assert [d.text for d in a.docs] == [d.text for d in b.docs]
    assert [d.text for d in a.docs] != [d.text for d in c.docs]
    path = write_corpus(str(tmp_path / "corpus"), 0)
    assert [d.text for d in load_corpus(path)] == [d.text for d in a.docs]


def test_multi_hop_parts_retrieve_their_documents():
    world = build_world(0)
    index = BM25Index(world.docs)
    rng = random.Random(0)
    for _ in range(60):
        c = lookup(rng, world)
        assert len(c.meta["hops"]) >= 2
        for hop in c.meta["hops"]:
            top = [d.id for d, _ in index.search(hop["query"], 3)]
            assert hop["doc_id"] in top, (c.problem, hop, top)
        # the answer is written in the last hop's document, and nowhere in the question
        last = next(d for d in world.docs if d.id == c.meta["hops"][-1]["doc_id"])
        assert c.answer in last.text and c.answer not in c.problem


def test_tool_call_returns_ids_cost_and_caps_k(tmp_path):
    tool = SearchTool({"corpus_seed": 0, "k_max": 2, "cost_per_query": 0.02})
    world = build_world(0)
    person = next(p for p, v in world.people.items() if v["company"])
    res = asyncio.run(tool.call({"query": person, "k": 50}, _ctx(tmp_path)))
    assert res.error is None and res.cost == 0.02
    assert len(res.meta["doc_ids"]) == 2 and world.doc_id[person] in res.meta["doc_ids"]
    assert f"[{world.doc_id[person]}]" in res.observation
    assert "$0.02 per query" in tool.schema()["function"]["description"]


@pytest.mark.parametrize(
    "args, message",
    [
        ({"query": "  "}, "empty"),
        ({"query": "x", "k": 0}, ">= 1"),
        ({"query": "x", "corpus": "/etc"}, "unknown argument 'corpus'"),  # the corpus is never the policy's to pick
        ({"k": 2}, "missing argument 'query'"),
    ],
)
def test_bad_arguments_are_error_observations(tmp_path, args, message):
    res = asyncio.run(SearchTool({}).call(args, _ctx(tmp_path)))
    assert res.error is not None and message in res.error and res.cost == 0.0


def test_corpus_folder_with_jsonl_and_txt(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"id": "j1", "title": "Zorblat", "text": "Zorblat lives in Quux."}) + "\n"
    )
    (tmp_path / "note.txt").write_text("Frobnitz\nFrobnitz is a river.")
    tool = SearchTool({"corpus": str(tmp_path)})
    res = asyncio.run(tool.call({"query": "frobnitz river"}, _ctx(tmp_path)))
    assert res.meta["doc_ids"][0] == "note"
    (tmp_path / "b.jsonl").write_text('{"id": "x"}\n')
    with pytest.raises(ValueError, match="b.jsonl:1"):
        load_corpus(str(tmp_path))


def test_a_simulated_expert_writes_the_task_s_queries_in_turn_and_is_billed_for_them(tmp_path):
    """``search`` with ``model``: a simulated writer writes the first of the task's ``meta.search_queries``
    not yet searched (the policy's own searches count), then the last again; without the list, the
    problem. The writer's tokens are billed on top of the search's price."""
    from tools_env.service_config import ExpertsConfig

    world = build_world(0)
    city, company = next(iter(world.cities)), next(iter(world.companies))
    tool = SearchTool({"experts": ExpertsConfig(), "k_default": 1, "cost_per_query": 0.0001})
    ctx = _ctx(tmp_path)
    ctx.task.meta = {"search_queries": [city, company]}
    first = asyncio.run(tool.call({"model": "expert-small"}, ctx))
    assert first.observation.startswith(f"expert-small searched for: {city}\n[{world.doc_id[city]}]")
    assert first.cost > 0.0001 and first.usage["completion_tokens"] >= 1 and first.meta["query"] == city
    second = asyncio.run(tool.call({"model": "expert-large"}, ctx))
    assert second.meta["query"] == company and second.meta["doc_ids"] == [world.doc_id[company]]
    assert second.cost > first.cost  # the dearer writer
    assert asyncio.run(tool.call({"model": "expert-small"}, ctx)).meta["query"] == company
    ctx = _ctx(tmp_path)
    ctx.task.meta = {"search_queries": [city, company]}
    asyncio.run(tool.call({"query": city.lower()}, ctx))  # the policy searched the first itself
    assert asyncio.run(tool.call({"model": "expert-small"}, ctx)).meta["query"] == company
    assert asyncio.run(tool.call({"model": "expert-small"}, _ctx(tmp_path))).meta["query"] == "q"  # no list


def test_without_experts_the_search_takes_only_a_query(tmp_path):
    tool = SearchTool({})
    assert "model" not in tool.schema()["function"]["parameters"]["properties"]
    res = asyncio.run(tool.call({"model": "expert-small"}, _ctx(tmp_path)))
    assert res.error and "missing argument 'query'" in res.observation
