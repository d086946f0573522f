"""Evaluation: Pareto front, utility, policy registry, tool-call parsing, and the recipe end to end."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from nemo_orchestra.evaluation.openai_policy import parse_reply
from nemo_orchestra.evaluation.policy import (
    POLICIES,
    Policy,
    PolicyFormatError,
    PolicyInput,
    ToolCall,
    build_policy,
    cheapest,
    expert_reply_answer,
    strongest,
)
from nemo_orchestra.evaluation.report import pareto_front
from nemo_orchestra.evaluation.runner import EpisodeResult, alpha_of
from nemo_orchestra.synth.pipeline import SynthConfig, synthesize

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pareto_front_by_hand():
    points = [(1.0, 0.5), (2.0, 0.4), (0.5, 0.5), (3.0, 0.9), (3.0, 0.8), (0.5, 0.5)]
    # (1, .5) and (2, .4) are beaten by (.5, .5); (3, .8) by (3, .9); equal points are both kept
    assert pareto_front(points) == [2, 5, 3]
    assert pareto_front([(0.0, 0.0)]) == [0]


def test_alpha_and_utility():
    assert alpha_of({"accuracy": 1.0, "cost": 1.0}) == 0.5
    assert alpha_of({"accuracy": 0.0, "cost": 0.0}) == 1.0
    r = EpisodeResult(task_id="t", category="c", domain=None, policy="p", preference="x", sample=0, correct=True,
                      reason="", cost=0.2, tool_cost=0.2, policy_cost=0.0, latency_s=0.0, turns=2, alpha=0.5)
    assert r.utility == pytest.approx(0.5 - 0.5 * 0.2)
    r.correct = False
    assert r.utility == pytest.approx(-0.1)


def test_registry_is_a_plain_dict_with_clear_errors():
    assert isinstance(POLICIES, dict) and {"strongest", "cheapest", "random", "openai", "checkpoint"} <= set(POLICIES)
    with pytest.raises(ValueError, match="unknown policy 'nope'; known policies: strongest"):
        build_policy("nope")
    with pytest.raises(FileNotFoundError, match="no Hugging Face export"):
        build_policy("checkpoint:/some/dir")
    with pytest.raises(ValueError, match="openai:URL:MODEL"):
        build_policy("openai:")
    assert build_policy("openai:http://127.0.0.1:9/v1:qwen").name == "openai:qwen"


def _input(prices, turn=0, messages=()):
    tools = [{"type": "function", "function": {"name": "expert", "description": "",
                                               "parameters": {"properties": {"model": {"enum": sorted(prices)}}}}}]
    return PolicyInput(task_id="t", problem="q", category="c", tools=tools, messages=list(messages), prices=prices,
                       preference={}, turn=turn)


def test_fixed_routing_reads_the_record_prices():
    prices = {"a": {"input": 0.1, "output": 9.0}, "b": {"input": 0.05, "output": 0.1}, "c": {"input": 2.0, "output": 2.0}}
    inp = _input(prices)
    assert strongest(inp) == "a" and cheapest(inp) == "b"
    prices["b"] = {"input": 5.0, "output": 20.0}  # repriced: now b is both the priciest and not the cheapest
    assert strongest(inp) == "b" and cheapest(inp) == "c"
    assert expert_reply_answer("expert-large: The answer is Boul.") == "Boul"
    assert expert_reply_answer("m: 42") == "42"


def test_parse_reply_both_formats():
    field = {"content": "", "tool_calls": [{"function": {"name": "search", "arguments": '{"query": "x"}'}}]}
    assert parse_reply(field) == ("search", {"query": "x"})
    text = {"content": '<think>hm</think>\n<tool_call>\n{"name": "answer", "arguments": {"answer": "7"}}\n</tool_call>'}
    assert parse_reply(text) == ("answer", {"answer": "7"})
    for bad in ({"content": "no call"}, {"content": "<tool_call>{nope}</tool_call>"},
                {"content": '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'}):
        with pytest.raises(PolicyFormatError):
            parse_reply(bad)


def _start_fake(tmp_path, records):
    oracle = tmp_path / "oracle.jsonl"
    oracle.write_text("".join(json.dumps({"key": r["problem"], "answer": r["answer"],
                                          "gold_actions": r["gold_actions"]}) + "\n" for r in records))
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "nemo_orchestra.synth.fake_openai", "--oracle", str(oracle),
                             "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    return proc, ready.read_text()


def test_evaluate_recipe_on_20_tasks_under_a_minute(tmp_path):
    data = tmp_path / "data"
    synthesize(SynthConfig(output=str(data), seed=0, num_tasks=200, eval_fraction=0.1, progress=False))
    records = [json.loads(line) for line in open(data / "eval.jsonl")]
    assert len(records) == 20
    proc, url = _start_fake(tmp_path, records)
    try:
        out = tmp_path / "eval"
        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.join(REPO, "recipes", "evaluate.py"), f"tasks={data / 'eval.jsonl'}",
               f"output={out}", f"policies=strongest,cheapest,random,openai:{url}:fake",
               "preferences=record,cost", "progress=false"]
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(5)
    assert run.returncode == 0, run.stderr[-3000:]
    assert wall < 60, f"evaluation of 20 tasks x 4 policies x 2 preferences took {wall:.1f}s"
    result = json.loads((out / "results.json").read_text())
    rows = {(r["policy"], r["preference"]): r for r in result["rows"]}
    assert len(rows) == 8 and all(r["n"] == 20 for r in rows.values())
    assert rows[("strongest", "record")]["accuracy"] > rows[("cheapest", "record")]["accuracy"]
    assert rows[("strongest", "record")]["mean_cost"] > rows[("cheapest", "record")]["mean_cost"]
    assert 0 < rows[("openai:fake", "record")]["accuracy"] < 1
    assert any(r["pareto"] for r in rows.values())
    for r in rows.values():
        assert sum(r["tool_share"].values()) == pytest.approx(1.0, abs=1e-3)
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 8
    if importlib.util.find_spec("matplotlib") is not None:  # the optional 'plot' extra
        assert (out / "pareto.png").stat().st_size > 10_000
    assert sum(1 for _ in open(out / "episodes.jsonl")) == 160


def test_evaluate_recipe_rejects_unknown_keys_and_unavailable_policies(tmp_path):
    base = [sys.executable, os.path.join(REPO, "recipes", "evaluate.py"), "tasks=x.jsonl", f"output={tmp_path}"]
    run = subprocess.run(base + ["polices=strongest"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.returncode != 0 and "unknown key 'polices'" in run.stderr
    run = subprocess.run(base + ["policies=checkpoint:/ckpt"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.returncode != 0 and "no Hugging Face export" in run.stderr


class _Recorder(Policy):
    def __init__(self):
        self.inputs = []

    async def act(self, inp):
        self.inputs.append(dataclasses.replace(inp, messages=list(inp.messages)))  # the runner appends later
        return ToolCall("answer", {"answer": "x"})


class _OneTurnService:
    async def create_episode(self, task):
        return {"episode_id": "e", "tools": []}

    async def step(self, eid, name, arguments):
        return {"observation": "ok", "done": True, "outcome": {"correct": False, "reason": "wrong"}}

    async def get_episode(self, eid):
        return {"total_cost": 0.0, "total_latency_s": 0.0, "turns": 1, "tool_counts": {}, "model_counts": {},
                "ended_by": "answer"}

    async def delete_episode(self, eid):
        pass


def test_checkpoint_policy_prompt_is_the_training_prompt():
    """Evaluating a checkpoint must show it the prompt it was trained on: the record's preference in
    words and weights; a preset preference replaces both (its weights, no profile words)."""
    import asyncio

    from nemo_orchestra.config import RewardConfig
    from nemo_orchestra.data.default_tasks import generate_tasks
    from nemo_orchestra.evaluation.checkpoint_policy import training_messages
    from nemo_orchestra.evaluation.runner import run_episode
    from nemo_orchestra.rollout.loop import prompt_messages

    task = generate_tasks(1, seed=5)[0]
    policy = _Recorder()
    asyncio.run(run_episode(_OneTurnService(), policy, task.to_dict(), preference=None))
    expected = prompt_messages(task, RewardConfig())
    assert training_messages(policy.inputs[0]) == expected
    assert "I want" in expected[-1]["content"]  # the profile in words reached the prompt
    preset = {"accuracy": 1.0, "cost": 0.5, "latency": 0.0}
    asyncio.run(run_episode(_OneTurnService(), policy, task.to_dict(), preference=preset, preference_name="p"))
    user = training_messages(policy.inputs[1])[-1]["content"]
    assert user.endswith("Preference weights: accuracy 1, cost 0.5, latency 0.") and "I want" not in user
