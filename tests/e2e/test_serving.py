"""What is trained is what is served: a short run's export behind vLLM's OpenAI-compatible server
(hermes tool parser) renders every turn of every episode to the token ids training kept,
evaluate.py's ``openai:`` policy on it decides as the ``checkpoint:`` policy does on the same tasks,
and sampled, each turn draws from its own seed whatever else the server is running. Each for the
embedded tokenizer and for a user's tokenizer carrying Qwen3's published chat template with
thinking on (tests/fixtures/chat_templates), which the run replaces by the prefix-preserving one."""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from nemo_orchestra.rollout.engines.vllm_memory import ipc_folder

ROOT = Path(__file__).resolve().parents[2]
RUN = [
    "warm_start.steps=150",
    "warm_start.lr=3e-3",  # a format-only warm start (no copy lessons, the faster rate): the default model, calls on most tasks
    "warm_start.copy_lessons=0",
    "trainer.max_steps=1",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.engine=hf",
    "evaluation.enabled=false",
    "model.max_position_embeddings=16384",  # room for a tau2 conversation (RoPE's tables only: the same model)
]
TAU2_CONTEXT = 12288  # tokens of a tau2 conversation the served model reads: a retail policy, its tools, the turns
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (scripts/setup.sh installs it)"
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _evaluate(tasks: Path, out: Path, policies: str, *options: str) -> list[dict]:
    """evaluate.py's episodes of ``policies`` on ``tasks``, 3 turns of 48 tokens at most."""
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes/evaluate.py"),
            f"tasks={tasks}",
            f"output={out}",
            f"policies={policies}",
            "max_turns=3",
            "openai.max_tokens=48",
            "progress=false",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]


def _qwen3_tokenizer(folder: Path) -> list[str]:
    """A user's tokenizer folder: the vocabulary the run would build (the embedded tokenizer, trained on its
    scripted warm-start episodes) with Qwen3's published chat template; the run's options that use it,
    thinking on."""
    import asyncio

    from nemo_orchestra.config import load_config
    from nemo_orchestra.data.default_tasks import generate_tasks, plan_phrases
    from nemo_orchestra.data.warm_start import render_text, scripted_episodes
    from nemo_orchestra.prompting.chat import PREFIX_QWEN3_TEMPLATE
    from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer
    from tools_env.client import ToolsEnvClient
    from tools_env.supervisor import start_service

    cfg = load_config([])
    with start_service({}) as svc:

        async def episodes():
            client = ToolsEnvClient(svc.urls)
            try:
                return await scripted_episodes(generate_tasks(cfg.warm_start.num_episodes, cfg.run.seed + 1), client, 0)
            finally:
                await client.aclose()

        scripted = asyncio.run(episodes())
    corpus = [render_text(ep, PREFIX_QWEN3_TEMPLATE, cfg.reward) for ep in scripted]
    tok = build_embedded_tokenizer(corpus, phrases=plan_phrases())
    tok.chat_template = (ROOT / "tests/fixtures/chat_templates/qwen3.jinja").read_text()
    tok.save_pretrained(str(folder))
    return [f"model.tokenizer={folder}", "model.enable_thinking=true"]


@pytest.fixture(scope="module", params=["embedded", "qwen3"])
def served(request, tmp_path_factory):
    """A short run, its export served by vLLM's OpenAI server; yields (run folder, base URL)."""
    run = tmp_path_factory.mktemp("run")
    extra = _qwen3_tokenizer(tmp_path_factory.mktemp("tokenizer")) if request.param == "qwen3" else []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONWARNINGS"] = "ignore"
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes/grpo_orchestrator.py"), f"run.output_dir={run}", *RUN, *extra],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    port = _free_port()
    log = open(run / "server.log", "w")
    ipc = ipc_folder()  # the server's ZMQ socket files, which outlive it
    env["VLLM_RPC_BASE_PATH"] = ipc
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(run / "hf"),
            "--served-model-name",
            "orchestrator",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--dtype",
            "float32",
            "--max-model-len",
            "16384",
            "--kv-cache-memory-bytes",
            str(256 << 20),
            "--enforce-eager",
            "--no-enable-chunked-prefill",  # seeded sampling on CPU (docs/checkpoints_and_export.md, "Serving")
            "--generation-config",
            "vllm",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (run / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM's server did not come up within 300 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield run, f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its engine processes
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()
        shutil.rmtree(ipc, ignore_errors=True)


def test_the_server_renders_every_turn_to_the_trained_ids(served):
    """The run's checkpoint plays 8 tasks in process, as its held-out evaluation does; at every turn of
    every episode, vLLM's ``/tokenize`` of the messages so far (with the tools and the run's template
    variables) is the token ids the turn was generated from."""
    from nemo_orchestra.data.default_tasks import generate_tasks
    from nemo_orchestra.evaluation.checkpoint_policy import checkpoint_policy, run_settings

    run, url = served
    settings = run_settings(str(run))
    policy = checkpoint_policy(str(run), max_new_tokens=settings.max_new_tokens)
    trajs, seen = _play_recorded(policy, generate_tasks(8, seed=11), {}, settings.limits, settings.default_preference)
    assert sum(len(t.turns) for t in trajs) > len(trajs)  # episodes went on past their first turn
    assert _served_as_trained(url, seen, settings.enable_thinking) == len(seen)  # greedy: every turn the same ids


def test_the_served_export_decides_as_the_checkpoint(served, tmp_path):
    from nemo_orchestra.data.default_tasks import generate_tasks

    run, url = served
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(t.to_json() + "\n" for t in generate_tasks(24, seed=99)))
    episodes = _evaluate(tasks, tmp_path / "ev", f"openai:{url}/v1:orchestrator,checkpoint:{run}")
    by_task: dict[str, dict[str, dict]] = {}
    for e in episodes:
        by_task.setdefault(e["task_id"], {})[e["policy"].split(":")[0]] = e

    def choices(e):  # each call: its tool and its arguments (expert alias, query, expression, answer)
        return [
            (tc["function"]["name"], json.loads(tc["function"]["arguments"]))
            for m in e["messages"]
            for tc in m.get("tool_calls") or []
        ]

    assert len(by_task) == 24 and all(set(v) == {"openai", "checkpoint"} for v in by_task.values())
    calling = sum(bool(choices(v["checkpoint"])) for v in by_task.values())
    assert calling >= 12, f"the checkpoint called tools on {calling} of 24 tasks"  # so the comparison has content
    same = sum(  # the same calls, and the server's parser finds the malformed turns ours finds
        choices(v["openai"]) == choices(v["checkpoint"])
        and v["openai"]["format_errors"] == v["checkpoint"]["format_errors"]
        for v in by_task.values()
    )
    print(f"the served export chose as the checkpoint on {same} of {len(by_task)} tasks ({calling} calling)")
    assert same >= 0.9 * len(by_task), f"the served export chose as the checkpoint on {same} of {len(by_task)} tasks"
    assert all(v["openai"]["reason"].split(":")[0] != "policy failed" for v in by_task.values())


def test_the_served_export_samples_each_turn_from_its_own_seed(served, tmp_path):
    """Sampled (temperature 0.7), 16 episodes at a time and then 2: the
    server batches different requests together, and every episode is the same, since each turn
    sends its own seed. Without unchunked prefill, the CPU server's engine would die on the first
    seeded prompt split over two steps."""
    from nemo_orchestra.data.default_tasks import generate_tasks

    _, url = served
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(t.to_json() + "\n" for t in generate_tasks(12, seed=5)))
    served = f"openai:{url}/v1:orchestrator"
    sampled = ("openai.temperature=0.7", "samples=2")
    wide = _evaluate(tasks, tmp_path / "wide", served, *sampled, "concurrency=16")
    narrow = _evaluate(tasks, tmp_path / "narrow", served, *sampled, "concurrency=2")
    assert len(wide) == 24 and all(e["reason"].split(":")[0] != "policy failed" for e in wide)
    assert [e["messages"] for e in wide] == [e["messages"] for e in narrow]
    greedy = _evaluate(tasks, tmp_path / "greedy", served, "samples=2")
    assert [e["messages"] for e in greedy] != [e["messages"] for e in wide]  # it did sample


@pytest.mark.parametrize("served", ["qwen3"], indirect=True)  # once, with the published template
def test_tau2_conversations_with_the_served_model_as_policy_and_user(served, tmp_path):
    """Two of tau2's retail test tasks with the same vLLM server as tau2's user (its UserSimulator over
    litellm's OpenAI client). evaluate.py plays the served export (``openai:``) and the oracle (whose answers
    reach the user) against it: nothing fails on what either model writes, the user's tokens are the
    user's, and every conversation ends with one of tau2's termination reasons in the results tau2 reads.
    The run's checkpoint in process, twice a task, sampling: at every turn the server renders the conversation
    so far to the ids the turn was generated from, or, after a turn sampled as another segmentation of its
    text, to the same text."""
    pytest.importorskip("tau2")
    import dataclasses

    from tau2.data_model.simulation import Results, TerminationReason

    from nemo_orchestra.evaluation.checkpoint_policy import checkpoint_policy, run_settings
    from tools_env.domains.tau2.importer import import_tasks
    from tools_env.task import load_jsonl

    run, url = served
    import_tasks(str(tmp_path), ["retail"], ["test"], limit=2)
    tasks = tmp_path / "retail_test.jsonl"
    user = {"base_url": f"{url}/v1", "model": "orchestrator", "price_in": 0.1, "price_out": 0.4, "max_tokens": 32}
    (tmp_path / "service.json").write_text(json.dumps({"user": user}))
    episodes = _evaluate(
        tasks, tmp_path / "ev", f"openai:{url}/v1:orchestrator,oracle", f"tools_env.config={tmp_path / 'service.json'}"
    )
    assert len(episodes) == 4 and all(e["reason"].split(":")[0] != "policy failed" for e in episodes), episodes
    oracle = [e for e in episodes if e["policy"] == "oracle"]
    # the oracle greets first: the user spoke, and its price is not the policy's (no expert calls: no tool cost)
    assert all(e["user_tokens_out"] > 0 and e["user_cost"] > 0 and e["tool_cost"] == 0.0 for e in oracle), oracle
    reasons = {r.value for r in TerminationReason}
    results = sorted((tmp_path / "ev").glob("tau2_retail_*.json"))
    assert len(results) == 2, results  # one a policy
    for path in results:
        sims = Results.load(path).simulations
        assert len(sims) == 2 and all(sim.termination_reason.value in reasons for sim in sims), path

    settings = run_settings(str(run))
    limits = dataclasses.replace(settings.limits, max_turns=4, task_turns=False, max_context=TAU2_CONTEXT)
    policy = checkpoint_policy(str(run), temperature=1.0, max_new_tokens=settings.max_new_tokens)
    trajs, seen = _play_recorded(policy, load_jsonl(str(tasks)), {"user": user}, limits, settings.default_preference, 2)
    assert len(trajs) == 4 and all(t.stop_reason != "policy_error" for t in trajs), [t.meta for t in trajs]
    assert sum(len(t.turns) for t in trajs) > len(trajs)
    exact = _served_as_trained(url, seen, settings.enable_thinking)
    assert exact >= len(trajs), (exact, len(seen))  # at least each episode's first turn: its prompt


def _play_recorded(policy, tasks, service, limits, default_preference, samples=1):
    """``samples`` episodes a task of ``policy`` on ``tasks`` in process, through a service of config
    ``service``; and at each turn: the messages so far, the tools, the ids it is generated from and the
    episode's retokenized turns so far."""
    import asyncio

    from nemo_orchestra.rollout.loop import run_episodes
    from tools_env.client import ToolsEnvClient
    from tools_env.supervisor import start_service

    seen = []
    act = policy.act

    async def recording(episodes):
        seen.extend(
            (json.loads(json.dumps(e.messages)), e.tools, list(e.traj.token_ids), e.traj.retokenized_turns)
            for e in episodes
        )
        return await act(episodes)

    policy.act = recording
    with start_service(service) as svc:

        async def play():
            client = ToolsEnvClient(svc.urls)
            try:
                return await run_episodes(
                    tasks, policy, client, samples=samples, limits=limits, default_preference=default_preference
                )
            finally:
                await client.aclose()

        return asyncio.run(play()), seen


def _served_as_trained(url, seen, enable_thinking) -> int:
    """Checks each recorded turn against vLLM's ``/tokenize`` of its messages (as evaluate.py's openai:
    policy sends them, with the tools and the run's template variables); returns how many were the same ids.
    A turn after none retokenized is rendered to exactly its ids; after one (a turn sampled as another
    segmentation of its text, which the run counts) to the same text."""
    from nemo_orchestra.prompting.chat import request_messages

    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    exact = 0
    for messages, tools, ids, retokenized in seen:
        body = {"model": "orchestrator", "messages": request_messages(messages), "tools": tools}
        body["add_generation_prompt"] = True
        rendered = _post(f"{url}/tokenize", {**body, "chat_template_kwargs": kwargs})["tokens"]
        if retokenized == 0:
            assert rendered == ids, _first_difference(url, rendered, ids)
            exact += 1
        else:
            assert _text(url, rendered) == _text(url, ids), _first_difference(url, rendered, ids)
    return exact


def _first_difference(url, rendered, ids):
    """Where the server's rendering and the trained ids part, as text."""
    at = next((i for i, (a, b) in enumerate(zip(rendered, ids)) if a != b), min(len(rendered), len(ids)))
    before, after = ids[max(0, at - 40) : at], slice(at, at + 40)
    return (
        f"token {at} of {len(rendered)} rendered, {len(ids)} trained; before it: {_text(url, before)!r}; "
        f"rendered: {_text(url, rendered[after])!r}; trained: {_text(url, ids[after])!r}"
    )


def _text(url, tokens):
    return _post(f"{url}/detokenize", {"model": "orchestrator", "tokens": tokens})["prompt"]
