"""Rollouts that run ahead of training: weights reach the engine between generate calls, each turn
records the version that wrote it and carries that version's logprobs into the loss's importance
weights, and ``RolloutsAhead`` starts step j's rollouts only within K versions of it."""

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.prompting.chat import (
    QWEN3_CHAT_TEMPLATE,
    ChatFormat,
    format_tool_call,
    render_chat,
    tool_call_message,
)
from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer
from nemo_orchestra.rollout.engines.base import Generation
from nemo_orchestra.rollout.loop import EnginePolicy, Episode, LoopLimits, run_episodes
from nemo_orchestra.rollout.scheduler import _ENGINE_THREAD, EngineThread, EngineWeights
from nemo_orchestra.train.rollout_source import RolloutsAhead
from nemo_orchestra.train.packing import pack
from nemo_orchestra.train.step import grpo_loss_fn
from nemo_orchestra.types import Trajectory
from tests.helpers import loss_cfg
from tools_env.client import ToolsEnvClient
from tools_env.supervisor import start_service
from tools_env.task import TaskRecord

TASK = TaskRecord.from_dict(
    {"problem": "What is 12 + 30?", "answer": "42", "category": "arithmetic", "tools": ["calculator", "answer"]}
)
TURNS = [format_tool_call("calculator", {"expression": "12 + 30"}), format_tool_call("answer", {"answer": "42"})]


@pytest.fixture(scope="module")
def chat():
    convo = [
        {"role": "user", "content": TASK.problem},
        tool_call_message("calculator", {"expression": "12 + 30"}),
        {"role": "tool", "content": "42"},
        tool_call_message("answer", {"answer": "42"}),
    ]
    return ChatFormat(build_embedded_tokenizer([render_chat(QWEN3_CHAT_TEMPLATE, convo, [])] * 4, vocab_size=600))


class VersionedEngine:
    """Writes the scripted turns; every generated token's logprob is -(w + 1) / 10 for the loaded weight w.
    Its first generate call has the trainer load version 1 meanwhile (from another thread, as the
    trainer's main thread does), so the load lands between the first and the second call."""

    def __init__(self, chat, weights: EngineWeights):
        self.chat, self.weights, self.w, self.calls, self.loader = chat, weights, 0.0, 0, None

    def load_weights(self, state):
        self.w = float(state["w"])

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop_ids, seeds=None):
        self.calls += 1
        if self.calls == 1:
            self.loader = threading.Thread(target=self.weights.load, args=(self, {"w": torch.tensor(1.0)}, 1))
            self.loader.start()
            time.sleep(0.3)  # the load is queued on the engine thread before this call returns
        out = []
        for p in prompts:
            turn = TURNS[0 if self.calls == 1 else 1]
            ids = self.chat.encode(turn) + [self.chat.end_of_turn_id]
            out.append(Generation(ids, [-(self.w + 1) / 10] * len(ids), True))
        return out


def test_weights_load_between_calls_and_each_turn_keeps_its_version_and_logprobs(chat):
    weights = EngineWeights(version=0)
    engine = VersionedEngine(chat, weights)
    cfg = load_config(["rollout.max_context=8192"])
    policy = EnginePolicy(engine, chat, 64, 1.0, weights=weights)
    with start_service() as svc:
        client = ToolsEnvClient(svc.urls)
        loop = asyncio.new_event_loop()
        (traj,) = loop.run_until_complete(
            run_episodes(
                [TASK], policy, client, limits=LoopLimits(max_turns=3), default_preference=cfg.reward.default_preference
            )
        )
        loop.run_until_complete(client.aclose())
        loop.close()
    engine.loader.join()
    assert traj.correct and len(traj.turns) == 2 and weights.version == 1
    assert [r.version for r in traj.turns] == [0, 1]
    generated = [lp for lp, m in zip(traj.gen_logprobs, traj.loss_mask) if m]
    first = len(chat.encode(TURNS[0])) + 1
    assert generated == pytest.approx([-0.1] * first + [-0.2] * (len(generated) - first))

    # the loss weighs each generated token by min(exp(old - gen), cap) with gen from the version that wrote it
    traj.advantage = 1.0
    (batch,) = pack([traj], capacity=4096)
    mask = batch.loss_mask_T.bool()
    old = torch.full_like(batch.loss_mask_T, -0.15)
    _, _, metrics = grpo_loss_fn(loss_cfg(tis_cap=1.02))(old.clone().requires_grad_(True), batch)
    expected = torch.exp(old - batch.gen_logprobs_T).clamp(max=1.02)[mask]
    # version 0's tokens: exp(-0.15 + 0.1) = 0.951; version 1's: exp(-0.15 + 0.2) = 1.051, capped at 1.02
    assert sorted(set(expected.tolist())) == pytest.approx([0.951229, 1.02], abs=1e-6)
    assert float(metrics["loss/tis_weight_mean"]) == pytest.approx(float(expected.mean()), rel=1e-6)
    # version 1's tokens are the capped ones
    assert float(metrics["loss/tis_capped_share"]) == pytest.approx(len(generated[first:]) / len(generated))


def test_engine_thread_runs_waiting_work_by_priority_then_submission_and_skips_cancelled():
    engine = EngineThread("test-engine")
    started, gate, order = threading.Event(), threading.Event(), []

    def running():
        started.set()
        gate.wait(10)
        order.append("running")

    def work(name):
        return lambda: order.append(name) or name

    first = engine.submit(running, priority=0)
    assert started.wait(10)
    futures = [
        engine.submit(work("step 3"), priority=3),
        engine.submit(work("step 2, first"), priority=2),
        engine.submit(work("step 2, second"), priority=2),
        engine.submit(work("cancelled"), priority=1),
        engine.submit(work("weight load"), priority=-float("inf")),
        engine.submit(work("step 1"), priority=1),
    ]
    assert futures[3].cancel()  # its caller gave up while it waited: never run
    gate.set()
    first.result(10)
    assert [f.result(10) for f in futures if not f.cancelled()] == [
        "step 3",
        "step 2, first",
        "step 2, second",
        "weight load",
        "step 1",
    ]
    assert order == ["running", "weight load", "step 1", "step 2, first", "step 2, second", "step 3"]

    def fails():
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        engine.submit(fails).result(10)
    assert engine.submit(work("after an error")).result(10) == "after an error"  # the thread goes on


def test_cancel_and_wait_drops_waiting_calls_and_waits_for_the_running_one():
    engine = EngineThread("test-engine")
    assert engine.cancel_and_wait(0.1)  # never started: nothing runs
    started, closed = threading.Event(), threading.Event()

    def generating():  # an engine call that ends once its engine is closed
        started.set()
        closed.wait(10)
        return "cut short"

    running = engine.submit(generating)
    assert started.wait(10)
    waiting = engine.submit(lambda: "never runs")
    assert not engine.cancel_and_wait(0.2)  # the running call has not returned
    assert waiting.cancelled()
    closed.set()
    assert engine.cancel_and_wait(10)
    assert running.result(0) == "cut short"
    assert engine.submit(lambda: "after").result(10) == "after"  # the thread takes new work


EXIT_WITH_A_CALL_IN_FLIGHT = """
import asyncio, sys, time
from types import SimpleNamespace
import torch
from nemo_orchestra.config import load_config
from nemo_orchestra.rollout.engines import EngineContext, start_engine
from nemo_orchestra.rollout.scheduler import _ENGINE_THREAD
from nemo_orchestra.rollout.managed_engine import ManagedEngine
from nemo_orchestra.train.trainer import Trainer

cfg = load_config([])
tok = SimpleNamespace(get_vocab=dict, eos_token_id=1, pad_token_id=0)
{model_setup}
engine = start_engine("{engine}", EngineContext(cfg.model, 256, tok, torch.device("cpu"), model=model), None)
call = _ENGINE_THREAD.submit(lambda: engine.generate([[5, 6, 7]] * 4, 1500, 1.0, 1.0, []))
time.sleep(0.5)  # the call runs: about 1500 decode steps
assert not call.done()

class Client:
    async def aclose(self):
        pass

trainer = SimpleNamespace(rollouts=SimpleNamespace(stop=lambda: None), logger=SimpleNamespace(close=lambda: None),
                          loop=asyncio.new_event_loop(), client=Client(), generation=ManagedEngine(engine=engine))
t0 = time.perf_counter()
Trainer.close(trainer)
assert call.done() and len(call.result()[0].token_ids) < 1500, "the call was not cut short"
print(f"closed in {{time.perf_counter() - t0:.2f}} s", flush=True)
"""


MODEL_SETUP = {  # hf builds its own model; megatron generates with the policy's
    "hf": "model = None",
    "megatron": "from nemo_orchestra.megatron.parallel import init_distributed\n"
    "from nemo_orchestra.train.learner import build_learner\n"
    "model = build_learner(cfg, 256, init_distributed(cfg.parallel, 0).device).module",
}


@pytest.mark.parametrize("engine", sorted(MODEL_SETUP))
def test_a_run_closing_with_an_engine_call_in_flight_ends_it_and_exits_cleanly(engine, tmp_path):
    """Rollouts ahead of training (or a second stop signal) leave a generate call running on the
    engine thread; an in-process engine's call must end with the trainer's close, or the process
    aborts at exit ("terminate called without an active exception") while torch runs on that thread."""
    model_setup = MODEL_SETUP[engine]
    script = EXIT_WITH_A_CALL_IN_FLIGHT.format(engine=engine, model_setup=model_setup)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "closed in" in out.stdout and "terminate called" not in out.stderr


def test_the_older_steps_turns_and_weight_loads_overtake_a_newer_steps_waiting_turn(chat):
    """Rollouts of two steps share the engine: while a call runs, the older step's next turn, and a
    weight load from the trainer, go before the newer step's turn that was queued first."""
    order, gate, started = [], threading.Event(), threading.Event()

    class Engine:
        def load_weights(self, state):
            order.append("weights")

        def generate(self, prompts, max_new_tokens, temperature, top_p, stop_ids, seeds=None):
            order.append(prompts[0][0])
            if prompts[0][0] == 0:
                started.set()
                gate.wait(10)
            return [Generation([chat.end_of_turn_id], [0.0], True) for _ in prompts]

    engine, weights = Engine(), EngineWeights()

    def episode(marker):
        traj = Trajectory(task=TASK, group=0, token_ids=[marker], loss_mask=[0], gen_logprobs=[0.0], prompt_len=1)
        return Episode(TASK, 0, 0, "", [], [], traj)

    def act(step, marker):
        policy = EnginePolicy(engine, chat, 8, 1.0, weights=weights, priority=step)
        return asyncio.run(policy.act([episode(marker)]))

    def queued(n):  # wait until n calls wait on the engine thread (the order they arrive in is the test's)
        deadline = time.monotonic() + 10
        while len(_ENGINE_THREAD._queue) < n:
            assert time.monotonic() < deadline, "the call never reached the engine thread"
            time.sleep(0.005)

    running = threading.Thread(target=act, args=(1, 0))  # step 1's turn, running when the others arrive
    running.start()
    assert started.wait(10)
    newer = threading.Thread(target=act, args=(2, 2))
    newer.start()
    queued(1)  # step 2's turn is queued first
    older = threading.Thread(target=act, args=(1, 1))
    older.start()
    queued(2)
    loader = threading.Thread(target=weights.load, args=(engine, {}, 1))
    loader.start()
    queued(3)
    gate.set()
    for t in (running, newer, older, loader):
        t.join(10)
    assert order == [0, "weights", 1, 2]


def test_async_rollouts_start_within_k_versions_and_drop_nothing_on_close():
    """take(s) starts steps s..s+K; a step never starts before the trainer took step j - K."""
    loop = asyncio.new_event_loop()
    started: list[tuple[int, int]] = []  # (step started, steps taken so far)
    taken = [0]
    gate = asyncio.Event()

    async def rollout(j):
        started.append((j, taken[0]))
        if j == 4:
            await gate.wait()  # still running when the run closes: cancelled
        return f"rollouts of step {j}"

    ahead = RolloutsAhead(loop, rollout, steps_ahead=2, last_step=5)
    results = []
    for s in range(4):
        value, waited = ahead.take(s)
        results.append(value)
        taken[0] += 1
        assert waited >= 0
    assert results == [f"rollouts of step {j}" for j in range(4)]
    deadline = time.monotonic() + 10
    while len(started) < 5 and time.monotonic() < deadline:  # step 4 was submitted; its coroutine starts soon
        time.sleep(0.01)
    assert all(j - k <= 2 for j, k in started), started  # step j started when at least j - 2 steps were taken
    assert sorted(j for j, _ in started) == [0, 1, 2, 3, 4]  # never past last_step
    ahead.close()
    assert not ahead.thread.is_alive() and not loop.is_running()
    loop.run_until_complete(asyncio.sleep(0))  # the loop is the caller's again
    loop.close()


def test_k0_starts_each_step_only_when_it_is_taken():
    loop = asyncio.new_event_loop()
    started: list[tuple[int, int]] = []
    taken = [0]

    async def rollout(j):
        started.append((j, taken[0]))
        return j

    ahead = RolloutsAhead(loop, rollout, steps_ahead=0, last_step=3)
    for s in range(3):
        assert ahead.take(s)[0] == s
        taken[0] += 1
    ahead.close()
    loop.close()
    assert started == [(0, 0), (1, 1), (2, 2)]
