"""Continuous batching (``rollout/engines/batching.py``): a call joins the sequences already decoding,
an exclusive function runs with none in flight, failures reach every caller; and the agent loop,
with a streaming engine, starts an episode's next turn while other turns are still decoding."""

import asyncio
import threading
import time

import pytest

from nemo_orchestra.config import load_config
from nemo_orchestra.prompting.chat import format_tool_call
from nemo_orchestra.rollout.engines.base import EngineCapabilities, Generation
from nemo_orchestra.rollout.engines.batching import ContinuousBatcher
from nemo_orchestra.rollout.loop import EnginePolicy, EngineWeights, LoopLimits, run_episodes
from tests.unit.test_rollout import FAST, SLOW, _task, chat, service  # noqa: F401  (fixtures)
from tools_env.client import ToolsEnvClient

STEP_S = 0.005


class CountingEngine:
    """A prompt [n, ...] decodes n tokens, one a step; each token is n and its logprob the weight ``w``
    at the time the prompt was added. Records what each step saw."""

    def __init__(self):
        self.w, self.steps, self.active, self.lock = 0.0, 0, {}, threading.Lock()
        self.log: list[str] = []
        self.fail_step: int | None = None
        self.refuse: int | None = None  # a prompt starting with this is refused at add_request

    def add_request(self, request_id, prompt, params):
        if prompt[0] == self.refuse:
            raise ValueError(f"prompt {prompt} refused")
        with self.lock:
            self.active[request_id] = [prompt[0], 0, self.w]

    def step(self):
        time.sleep(STEP_S)
        with self.lock:
            self.steps += 1
            if self.steps == self.fail_step:
                raise RuntimeError("engine core died")
            done = []
            for rid, s in list(self.active.items()):
                s[1] += 1
                if s[1] == s[0]:
                    del self.active[rid]
                    done.append((rid, Generation([s[0]] * s[0], [s[2]] * s[0], True)))
            return done

    def abort_requests(self, request_ids):
        with self.lock:
            for r in request_ids:
                self.active.pop(r, None)


@pytest.fixture
def batcher():
    engine = CountingEngine()
    b = ContinuousBatcher(engine)
    yield b
    b.close()


def wait_until(cond, timeout_s=5.0):
    t0 = time.perf_counter()
    while not cond():
        assert time.perf_counter() - t0 < timeout_s, "timed out"
        time.sleep(0.001)


def test_a_call_joins_the_sequences_in_flight_and_each_gets_its_own_results_in_order(batcher):
    e = batcher.engine
    long = batcher.submit([[60], [40]], None)
    wait_until(lambda: e.steps >= 3)
    short = batcher.submit([[4], [2], [3]], None, on_admit=lambda: "admitted")
    tag, gens = short.result(timeout=5)
    assert e.steps < 20 and not long.done()  # done beside the long call, not after it
    assert tag == "admitted" and [g.token_ids for g in gens] == [[4] * 4, [2] * 2, [3] * 3]
    tag, gens = long.result(timeout=5)
    assert tag is None and [len(g.token_ids) for g in gens] == [60, 40]
    assert e.steps == 60  # the long call's 60 steps carried the short one: no step of its own


def test_exclusive_runs_with_nothing_in_flight_and_later_calls_wait_for_it(batcher):
    e = batcher.engine
    before = batcher.submit([[30]], None)
    wait_until(lambda: e.steps >= 1)
    seen = {}

    def load():
        seen["active"], seen["steps"] = len(e.active), e.steps
        time.sleep(0.05)
        e.w = 1.0
        return "loaded"

    sync = batcher.exclusive(load)
    after = batcher.submit([[2]], None, on_admit=lambda: e.w)
    assert sync.result(timeout=5) == "loaded"
    assert seen == {"active": 0, "steps": 30}  # the earlier call finished first, and nothing joined it
    assert before.result(timeout=5)[1][0].logprobs == [0.0] * 30  # written by the old weights only
    version, (gen,) = after.result(timeout=5)
    assert version == 1.0 and gen.logprobs == [1.0, 1.0]


def test_an_exclusive_error_reaches_its_caller_and_the_batcher_goes_on(batcher):
    def broken():
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        batcher.exclusive(broken).result(timeout=5)
    assert batcher.submit([[2]], None).result(timeout=5)[1][0].token_ids == [2, 2]


def test_a_refused_prompt_fails_its_call_only(batcher):
    batcher.engine.refuse = 7
    other = batcher.submit([[20]], None)
    refused = batcher.submit([[3], [7]], None)
    with pytest.raises(ValueError, match=r"prompt \[7\] refused"):
        refused.result(timeout=5)
    assert other.result(timeout=5)[1][0].token_ids == [20] * 20
    assert not batcher.engine.active  # the refused call's first prompt was dropped, not left decoding


def test_an_engine_failure_fails_the_calls_in_flight_and_every_later_one(batcher):
    batcher.engine.fail_step = 3
    first = batcher.submit([[10]], None)
    with pytest.raises(RuntimeError, match="the engine failed: RuntimeError: engine core died") as info:
        first.result(timeout=5)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="engine core died"):
        batcher.submit([[2]], None).result(timeout=5)
    with pytest.raises(RuntimeError, match="engine core died"):
        batcher.exclusive(lambda: None).result(timeout=5)


def test_close_fails_what_is_left_and_ends_the_thread():
    b = ContinuousBatcher(CountingEngine())
    pending = b.submit([[10_000]], None)
    wait_until(lambda: b.engine.steps >= 1)
    b.close()
    assert not b._thread.is_alive()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        pending.result(timeout=5)
    with pytest.raises(RuntimeError, match="the engine is closed"):
        b.submit([[1]], None).result(timeout=5)


# ---- the agent loop with a streaming engine ------------------------------------------------------------


class StreamingEngine:
    """Scripted turns (as ``test_rollout.ScriptedEngine``) decoded one token a step by a batcher: a turn
    of n tokens takes n steps, and the slow task's first turn is padded to ``SLOW_STEPS`` steps."""

    capabilities = EngineCapabilities(continuous_batching=True)
    SLOW_STEPS = 80

    def __init__(self, chat_format):
        self.chat, self.w, self.active, self.finished_at = chat_format, 0.0, {}, {}
        self.batcher = ContinuousBatcher(self)

    def _turn(self, prompt):
        text = self.chat.decode(prompt)
        if "<tool_response>" in text:
            call, steps = format_tool_call("answer", {"answer": "42"}), 0
        elif SLOW in text:
            call, steps = format_tool_call("expert", {"model": "expert-large", "query": SLOW}), self.SLOW_STEPS
        else:
            call, steps = format_tool_call("calculator", {"expression": "12 + 30"}), 0
        ids = self.chat.encode(call) + [self.chat.end_of_turn_id]
        return ids, max(steps, 1), SLOW in text, "<tool_response>" in text

    # SteppedEngine
    def add_request(self, request_id, prompt, params):
        ids, steps, slow, second = self._turn(prompt)
        self.active[request_id] = [ids, steps, self.w, (slow, second)]

    def step(self):
        time.sleep(STEP_S)
        done = []
        for rid, s in list(self.active.items()):
            s[1] -= 1
            if s[1] == 0:
                del self.active[rid]
                self.finished_at.setdefault(s[3], time.perf_counter())
                done.append((rid, Generation(s[0], [-s[2]] * len(s[0]), True)))
        return done

    def abort_requests(self, request_ids):
        for r in request_ids:
            self.active.pop(r, None)

    # GenerationEngine
    def submit(self, prompts, max_new_tokens, temperature, top_p, stop_ids, on_admit=None):
        return self.batcher.submit(prompts, None, on_admit)

    def exclusive(self, fn):
        return self.batcher.exclusive(fn)

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop_ids):
        return self.submit(prompts, max_new_tokens, temperature, top_p, stop_ids).result()[1]

    def load_weights(self, state):
        self.w = float(state["w"])


def _run(engine, chat, service, weights=None, stats=None):  # noqa: F811
    policy = EnginePolicy(engine, chat, 64, 1.0, weights=weights)
    client = ToolsEnvClient(service)

    async def go():
        try:
            return await run_episodes(
                [_task(SLOW, "reasoning"), _task(FAST, "arithmetic")],
                policy,
                client,
                limits=LoopLimits(max_turns=3),
                default_preference=load_config([]).reward.default_preference,
                stats=stats,
            )
        finally:
            await client.aclose()

    try:
        return asyncio.run(go())
    finally:
        engine.batcher.close()


def test_the_loop_starts_a_turn_while_other_turns_decode(service, chat):  # noqa: F811
    engine, stats = StreamingEngine(chat), {}
    slow, fast = _run(engine, chat, service, stats=stats)
    assert fast.stop_reason == "answer" and fast.correct and fast.turns == 2 and slow.turns >= 1
    # the fast episode's answer turn was asked for, decoded and finished while the slow episode's
    # first turn was still decoding (one call at a time would have waited for that turn to end)
    assert engine.finished_at[(False, True)] < engine.finished_at[(True, False)]
    assert stats["generate_calls"] >= 3
    # generation time is wall time with a call in flight, overlapping calls counted once
    assert StreamingEngine.SLOW_STEPS * STEP_S <= stats["generate_s"] < 3 * StreamingEngine.SLOW_STEPS * STEP_S


def test_a_weight_load_waits_for_the_turns_decoding_and_later_turns_record_the_new_version(service, chat):  # noqa: F811
    engine, weights = StreamingEngine(chat), EngineWeights(version=0)

    def load():
        while not engine.active:  # both first turns are decoding
            time.sleep(0.001)
        weights.load(engine, {"w": 1.0}, 1)

    loader = threading.Thread(target=load)
    loader.start()
    slow, fast = _run(engine, chat, service, weights=weights)
    loader.join()
    assert weights.version == 1 and fast.turns == 2
    assert slow.turn_versions[0] == 0 and fast.turn_versions == [0, 1]
    # the answer turn waited for the load, and the load for the slow turn in flight
    assert engine.finished_at[(False, True)] > engine.finished_at[(True, False)]
    generated = [lp for lp, m in zip(fast.gen_logprobs, fast.loss_mask) if m]
    assert set(generated) == {-0.0, -1.0}  # each turn's logprobs from the weights that wrote it
