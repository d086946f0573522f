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

from nemo_orchestra.evaluation.openai_policy import OpenAIChatPolicy
from nemo_orchestra.evaluation.policies import POLICIES, build_policy, cheapest, expert_reply_answer, strongest
from nemo_orchestra.evaluation.report import pareto_front
from nemo_orchestra.evaluation.harness import EpisodeResult, alpha_of
from nemo_orchestra.rollout.loop import Episode, turn_seed
from nemo_orchestra.synth.pipeline import SynthConfig, synthesize
from tests.doubles import ORACLE_CHAT_SERVER

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


def test_an_endpoint_gets_each_turn_its_own_seed():
    """The seed sent with a turn is the engine policy's for the same turn (``turn_seed``): a served
    export samples a turn from the seed training would, and no two turns or samples share one."""
    policy = OpenAIChatPolicy("http://127.0.0.1:1/v1", "m", temperature=0.7)
    ep = _input({"a": {"input": 1.0, "output": 1.0}})
    seeds = []
    for sample, turns in ((0, 3), (1, 3)):
        ep.sample, ep.seed = sample, f"heldout/{sample}"
        for turn in range(turns):
            ep.traj = type("T", (), {"turns": [None] * turn})()  # turn records: only their number counts
            body = policy.request(ep)
            assert body["seed"] == turn_seed(ep)
            seeds.append(body["seed"])
    assert len(set(seeds)) == len(seeds)
    assert "seed" not in OpenAIChatPolicy("http://x/v1", "m", send_seed=False).request(ep)


def test_a_request_on_a_connection_the_server_closed_is_sent_again():
    """A server that closes a kept-alive connection when the next request arrives on it (as one that
    closed it while idle does to a pool that reuses it): the turn is the server's reply from a fresh
    connection, not a failed episode; a server that disconnects every request still fails the episode."""
    import asyncio

    reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": "hi"}}], "usage": {}}).encode()
    requests = []

    async def read_request(reader):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        await reader.readexactly(length)

    async def main(answer_again):
        async def serve(reader, writer):
            await read_request(reader)
            requests.append(writer.get_extra_info("peername"))
            if answer_again or len(requests) == 1:  # the first request on the first connection is answered
                head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(reply)}\r\n\r\n"
                writer.write(head.encode() + reply)
                await writer.drain()
                try:
                    await read_request(reader)  # the next one on this connection: closed unanswered
                    requests.append(writer.get_extra_info("peername"))
                except asyncio.IncompleteReadError:
                    pass
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        policy = OpenAIChatPolicy(f"http://127.0.0.1:{port}/v1", "m")
        ep = _input({"a": {"input": 1.0, "output": 1.0}})
        ep.traj = type("T", (), {"turns": []})()
        try:
            return [await policy.turn(ep) for _ in range(2)]
        finally:
            await policy.aclose()
            server.close()

    first, second = asyncio.run(main(answer_again=True))
    assert first.text == second.text == "hi" and first.failure is None and second.failure is None
    assert len(requests) == 3 and requests[1] == requests[0] != requests[2]  # sent again on a new connection
    requests.clear()
    first, second = asyncio.run(main(answer_again=False))
    assert first.text == "hi" and "ServerDisconnectedError" in second.failure and len(requests) == 3


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
        [sys.executable, ORACLE_CHAT_SERVER, "--oracle", str(oracle), "--ready-file", str(ready)],
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


def _recipe():
    spec = importlib.util.spec_from_file_location("evaluate_recipe", os.path.join(REPO, "recipes", "evaluate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _counting_task(calls: int, max_turns=None) -> dict:
    """A record whose oracle takes ``calls`` calculator calls and then its answer: calls + 1 turns."""
    record = {
        "id": f"count-{calls}-{max_turns}",
        "problem": "What is 6 * 7?",
        "answer": "42",
        "category": "arithmetic",
        "tools": ["calculator", "answer"],
        "gold_actions": [{"name": "calculator", "arguments": {"expression": "6 * 7"}}] * calls,
    }
    return record if max_turns is None else {**record, "max_turns": max_turns}


@pytest.mark.parametrize(
    "key, turns, correct",
    [
        (None, [3, 4], [False, True]),  # each record's own budget: 3 cuts the first, 4 lets the second answer
        (12, [4, 4], [True, True]),  # max_turns=12 overrides both records' budgets
        (3, [3, 3], [False, False]),
    ],
)
def test_an_episode_runs_under_its_records_budget_unless_max_turns_is_given(tmp_path, key, turns, correct):
    import asyncio

    from tools_env.client import ToolsEnvClient
    from tools_env.supervisor import start_service
    from tools_env.task import TaskRecord

    evaluate = _recipe()
    records = [TaskRecord.from_dict(_counting_task(3, max_turns=3)), TaskRecord.from_dict(_counting_task(3, 4))]
    cfg = evaluate.EvalConfig(tasks="t.jsonl", output="o", policies="oracle", max_turns=key)
    runs = evaluate.policy_runs(cfg, records)
    assert (runs[0].limits.max_turns, runs[0].limits.task_turns) == ((12, True) if key is None else (key, False))

    async def go(urls):
        client = ToolsEnvClient(urls)
        try:
            return await evaluate.run_all(client, runs, records, {"record": None}, progress=False)
        finally:
            await client.aclose()

    with start_service({}) as svc:
        results = asyncio.run(go(svc.urls))
    assert [r.turns for r in results] == turns and [r.correct for r in results] == correct, [r.reason for r in results]


def _fake_checkpoint(monkeypatch, max_turns=3, tokens=48, enable_thinking=None):
    """``checkpoint:run`` as a run folder whose settings are ``max_turns`` turns and ``tokens`` a turn,
    without a model: ``run_settings`` and the policy builder stand in."""
    from nemo_orchestra.evaluation import checkpoint_policy
    from nemo_orchestra.evaluation.checkpoint_policy import RunSettings
    from nemo_orchestra.evaluation.policies import Policy
    from nemo_orchestra.rollout.loop import LoopLimits

    settings = RunSettings(
        LoopLimits(max_turns=max_turns, task_turns=True, max_context=1024, turn_tokens=tokens),
        tokens,
        {"accuracy": 1.0, "cost": 0.0, "latency": 0.0},
        enable_thinking,
    )
    monkeypatch.setattr(checkpoint_policy, "run_settings", lambda path: settings if path == "run" else None)

    def build(arg, options):
        policy = Policy()
        policy.name, policy.max_new_tokens = f"checkpoint:{arg}", tokens
        return policy

    monkeypatch.setitem(POLICIES, "checkpoint", build)
    return settings


def test_a_served_policy_beside_a_checkpoint_runs_under_the_runs_limits(monkeypatch, capsys):
    evaluate = _recipe()
    settings = _fake_checkpoint(monkeypatch)
    both = "openai:http://127.0.0.1:9/v1:m,checkpoint:run"
    served, ckpt = evaluate.policy_runs(evaluate.EvalConfig(policies=both), [])
    assert ckpt.limits is settings.limits and ckpt.policy.name == "checkpoint:run"
    assert (served.limits.max_turns, served.limits.task_turns, served.policy.max_tokens) == (3, True, 48)
    assert served.limits.price_in == evaluate.OrchestratorPrices().price_in  # only the turn and token limits
    assert capsys.readouterr().out == ""  # the same limits: nothing to say

    alone = evaluate.policy_runs(evaluate.EvalConfig(policies="openai:http://127.0.0.1:9/v1:m"), [])[0]
    assert (alone.limits.max_turns, alone.limits.task_turns, alone.policy.max_tokens) == (12, True, 1024)


@pytest.mark.parametrize(
    "given, want, line",
    [
        ({"max_turns": 5}, (5, False, 48), "openai:m: max_turns=5, max_tokens=48; checkpoint:run: max_turns=record|3"),
        (
            {"openai": {"max_tokens": 100}},
            (3, True, 100),
            "openai:m: max_turns=record|3, max_tokens=100; checkpoint:run: max_turns=record|3, max_tokens=48",
        ),
    ],
)
def test_a_given_limit_wins_over_the_runs_and_the_difference_is_printed(monkeypatch, capsys, given, want, line):
    evaluate = _recipe()
    _fake_checkpoint(monkeypatch)
    openai = evaluate.OpenAIOptions(**given.get("openai", {}))
    cfg = evaluate.EvalConfig(
        policies="openai:http://127.0.0.1:9/v1:m,checkpoint:run", max_turns=given.get("max_turns"), openai=openai
    )
    served, ckpt = evaluate.policy_runs(cfg, [])
    assert (served.limits.max_turns, served.limits.task_turns, served.policy.max_tokens) == want
    assert ckpt.limits.max_turns == 3
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("policies run under different limits") and line in out[0], out


def test_a_policy_without_tokens_differs_only_by_its_turns(monkeypatch, capsys):
    evaluate = _recipe()
    _fake_checkpoint(monkeypatch, max_turns=12)
    evaluate.policy_runs(evaluate.EvalConfig(policies="strongest,cheapest,checkpoint:run"), [])
    assert capsys.readouterr().out == ""  # a fixed policy has no tokens per turn to differ by
    evaluate.policy_runs(evaluate.EvalConfig(policies="strongest,cheapest,checkpoint:run", max_turns=4), [])
    out = capsys.readouterr().out
    assert "strongest, cheapest: max_turns=4; checkpoint:run: max_turns=record|12, max_tokens=48" in out, out


def test_limits_keys_are_checked_and_the_local_guard_covers_the_budgets(tmp_path):
    evaluate = _recipe()
    for key, cfg in (
        ("max_turns", evaluate.EvalConfig(tasks="t", output="o", max_turns=0)),
        ("openai.max_tokens", evaluate.EvalConfig(tasks="t", output="o", openai=evaluate.OpenAIOptions(max_tokens=0))),
    ):
        with pytest.raises(ValueError, match=f"{key}: must be >= 1"):
            cfg.validate()
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps(_counting_task(1, 56)) + "\n" + json.dumps(_counting_task(1)) + "\n")
    assert evaluate.service_config(evaluate.EvalConfig(tasks=str(tasks)))["guards"] == {"max_turns": 56}
    assert evaluate.service_config(evaluate.EvalConfig(tasks=str(tasks), max_turns=40))["guards"] == {"max_turns": 40}
    tasks.write_text(json.dumps(_counting_task(1, 5)) + "\n")
    assert evaluate.service_config(evaluate.EvalConfig(tasks=str(tasks)))["guards"] == {"max_turns": 30}
    config = tmp_path / "service.yaml"
    config.write_text("guards: {max_turns: 7}\n")
    given = evaluate.EvalConfig(tasks=str(tasks), max_turns=40, tools_env=evaluate.ToolsEnvOptions(config=str(config)))
    assert evaluate.service_config(given)["guards"] == {"max_turns": 7}  # the file's guard stays


def test_a_served_policy_renders_with_the_runs_thinking_switch(monkeypatch):
    """``model.enable_thinking`` of the run beside it is sent as ``chat_template_kwargs``, unless
    ``openai.enable_thinking`` is given; with neither, nothing is sent."""
    evaluate = _recipe()
    _fake_checkpoint(monkeypatch, enable_thinking=False)
    ep = _input({"a": {"input": 1.0, "output": 1.0}})
    ep.traj = type("T", (), {"turns": []})()
    both = "openai:http://127.0.0.1:9/v1:m,checkpoint:run"
    served = evaluate.policy_runs(evaluate.EvalConfig(policies=both), [])[0].policy
    assert served.request(ep)["chat_template_kwargs"] == {"enable_thinking": False}
    given = evaluate.EvalConfig(policies=both, openai=evaluate.OpenAIOptions(enable_thinking=True))
    assert evaluate.policy_runs(given, [])[0].policy.request(ep)["chat_template_kwargs"] == {"enable_thinking": True}
    alone = evaluate.policy_runs(evaluate.EvalConfig(policies="openai:http://127.0.0.1:9/v1:m"), [])[0].policy
    assert "chat_template_kwargs" not in alone.request(ep)


def test_a_runs_checkpoint_is_evaluated_with_the_tool_service_it_trained_with(tmp_path):
    """The default recipe's search (one document, its price): a local service for ``checkpoint:RUN`` runs with
    the run's ``tools.service``, a given file's keys over it; runs trained with different ones are refused."""
    from nemo_orchestra.config import load_config, save_config

    evaluate = _recipe()
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps(_counting_task(1, 5)) + "\n")
    runs = {}
    for name, k in (("a", 1), ("b", 3)):
        (tmp_path / name / "hf").mkdir(parents=True)
        (tmp_path / name / "hf" / "config.json").write_text("{}")
        save_config(load_config([f"tools.service.tools.search.k_default={k}"]), str(tmp_path / name / "config.yaml"))
        runs[name] = f"checkpoint:{tmp_path / name}"
    search = evaluate.service_config(evaluate.EvalConfig(tasks=str(tasks), policies=runs["a"]))["tools"]["search"]
    assert search["k_default"] == 1 and search["cost_per_query"] == 0.0001  # tiny_cpu's, not the tool's own
    config = tmp_path / "service.yaml"
    config.write_text("tools: {search: {cost_per_query: 0.01}}\n")
    given = evaluate.EvalConfig(
        tasks=str(tasks), policies=runs["a"], tools_env=evaluate.ToolsEnvOptions(config=str(config))
    )
    assert evaluate.service_config(given)["tools"]["search"] == {**search, "cost_per_query": 0.01}
    assert "search" not in evaluate.service_config(evaluate.EvalConfig(tasks=str(tasks))).get("tools", {})
    with pytest.raises(ValueError, match="different tool service configs"):
        evaluate.service_config(evaluate.EvalConfig(tasks=str(tasks), policies=f"{runs['a']},{runs['b']}"))
