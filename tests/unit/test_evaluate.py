"""Evaluation: Pareto front, utility, policy registry, tool-call parsing, and the recipe end to end."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from nemo_orchestra.evaluation.openai_policy import OpenAIChatPolicy, parse_reply
from nemo_orchestra.evaluation.policy import POLICIES, build_policy, cheapest, expert_reply_answer, strongest
from nemo_orchestra.evaluation.report import pareto_front
from nemo_orchestra.evaluation.runner import EpisodeResult, alpha_of
from nemo_orchestra.prompting.chat import ToolCall
from nemo_orchestra.rollout.loop import Episode, turn_seed
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
    r = EpisodeResult(
        task_id="t",
        category="c",
        domain=None,
        policy="p",
        preference="x",
        sample=0,
        correct=True,
        reason="",
        cost=0.2,
        tool_cost=0.2,
        policy_cost=0.0,
        latency_s=0.0,
        turns=2,
        alpha=0.5,
    )
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


def _input(prices):
    from tools_env.task import TaskRecord

    tools = [
        {
            "type": "function",
            "function": {
                "name": "expert",
                "description": "",
                "parameters": {"properties": {"model": {"enum": sorted(prices)}}},
            },
        }
    ]
    task = TaskRecord(problem="q", answer="a", category="c", tools=["expert", "answer"], prices=prices)
    return Episode(task, 0, 0, "e", tools, [], None)


def test_fixed_routing_reads_the_record_prices():
    prices = {
        "a": {"input": 0.1, "output": 9.0},
        "b": {"input": 0.05, "output": 0.1},
        "c": {"input": 2.0, "output": 2.0},
    }
    inp = _input(prices)
    assert strongest(inp) == "a" and cheapest(inp) == "b"
    prices["b"] = {"input": 5.0, "output": 20.0}  # repriced: now b is both the priciest and not the cheapest
    assert strongest(inp) == "b" and cheapest(inp) == "c"
    assert expert_reply_answer("expert-large: The answer is Boul.") == "Boul"
    assert expert_reply_answer("m: 42") == "42"


def test_parse_reply_both_formats():
    field = {
        "content": "<think>p</think>\n",
        "tool_calls": [{"function": {"name": "search", "arguments": '{"query": "x"}'}}],
    }
    assert parse_reply(field) == ("<think>p</think>\n", ToolCall("search", {"query": "x"}))
    text = '<think>hm</think>\n<tool_call>\n{"name": "answer", "arguments": {"answer": "7"}}\n</tool_call>'
    assert parse_reply({"content": text}) == (text, None)  # the loop reads the call from the text
    bad = {"content": "", "tool_calls": [{"function": {"name": "a", "arguments": "[1]"}}]}
    shown, call = parse_reply(bad)  # not an object: left in the text, where the loop's parser rejects it
    assert call is None and shown == '<tool_call>\n{"name": "a", "arguments": [1]}\n</tool_call>'


def test_an_endpoint_gets_each_turn_its_own_seed():
    """The seed sent with a turn is the engine policy's for the same turn (``turn_seed``): a served
    export samples a turn from the seed training would, and no two turns or samples share one."""
    policy = OpenAIChatPolicy("http://127.0.0.1:1/v1", "m", temperature=0.7)
    ep = _input({"a": {"input": 1.0, "output": 1.0}})
    seeds = []
    for sample, turns in ((0, 3), (1, 3)):
        ep.sample, ep.seed = sample, f"heldout/{sample}"
        for turn in range(turns):
            ep.traj = type("T", (), {"turns": turn})()
            body = policy.request(ep)
            assert body["seed"] == turn_seed(ep)
            seeds.append(body["seed"])
    assert len(set(seeds)) == len(seeds)
    assert "seed" not in OpenAIChatPolicy("http://x/v1", "m", send_seed=False).request(ep)


def _start_fake(tmp_path, records):
    oracle = tmp_path / "oracle.jsonl"
    oracle.write_text(
        "".join(
            json.dumps({"key": r["problem"], "answer": r["answer"], "gold_actions": r["gold_actions"]}) + "\n"
            for r in records
        )
    )
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nemo_orchestra.synth.fake_openai", "--oracle", str(oracle), "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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
        cmd = [
            sys.executable,
            os.path.join(REPO, "recipes", "evaluate.py"),
            f"tasks={data / 'eval.jsonl'}",
            f"output={out}",
            f"policies=strongest,cheapest,random,openai:{url}:fake",
            "preferences=record,cost",
            "progress=false",
        ]
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
    assert run.returncode != 0 and "polices: unknown config key" in run.stderr
    run = subprocess.run(base + ["policies=checkpoint:/ckpt"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.returncode != 0 and "no Hugging Face export" in run.stderr
    (tmp_path / "run" / "hf").mkdir(parents=True)  # a run folder whose config.yaml is not a run's
    (tmp_path / "run" / "hf" / "config.json").write_text("{}")
    (tmp_path / "run" / "config.yaml").write_text("rollout: {max_turns: 3}\n")
    run = subprocess.run(
        base + [f"policies=checkpoint:{tmp_path / 'run'}"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert run.returncode == 2 and "lacks the run setting 'max_context'" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    (tmp_path / "empty.jsonl").write_text("\n")
    run = subprocess.run(
        [*base[:2], f"tasks={tmp_path / 'empty.jsonl'}", f"output={tmp_path}", "policies=cheapest"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert run.returncode == 2 and "holds no task records" in run.stderr, run.stderr[-2000:]
