"""Rollouts against a real tool service with a scripted engine: token ids kept exactly as
generated, and generation overlapping slow tool calls."""

import asyncio
import re
import threading
import time

import pytest

from nemo_orchestra.prompting.chat import (
    QWEN3_CHAT_TEMPLATE,
    ChatFormat,
    format_tool_call,
    render_chat,
    tool_call_message,
)
from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer
from nemo_orchestra.rollout.engines.base import Generation
from nemo_orchestra.prompting.prompts import task_messages, with_default_preference
from nemo_orchestra.rollout.loop import EnginePolicy, LoopLimits, run_episodes
from tests.helpers import reward_cfg
from tools_env.client import ToolsEnvClient
from tools_env.supervisor import start_service
from tools_env.task import TaskRecord

SLOW, FAST = "Which word does Kalo hide?", "What is 12 + 30?"


def _rollout_cfg(**kw):
    from nemo_orchestra.config import RolloutConfig

    base = dict(
        engine="hf",
        group_size=2,
        max_turns=3,
        max_new_tokens_per_turn=64,
        max_context=2048,
        temperature=1.0,
        top_p=1.0,
        orchestrator_price_in=0.2,
        orchestrator_price_out=0.2,
        sync_timeout_s=10.0,
        batch_window_s=0.01,
    )
    base.update(kw)
    return RolloutConfig(**base)


def run_rollouts(tasks, group_size, engine, client, chat, cfg, reward, stats=None):
    """Training's rollouts: the engine as the policy of the agent loop (as ``Episodes.run``)."""
    policy = EnginePolicy(engine, chat, cfg.max_new_tokens_per_turn, cfg.temperature, cfg.top_p)
    return run_episodes(
        tasks,
        policy,
        client,
        samples=group_size,
        limits=LoopLimits.from_rollout(cfg),
        default_preference=reward.default_preference,
        stats=stats,
    )


@pytest.fixture(scope="module")
def service():
    # a simulated expert that really waits its latency: 8-10 s scaled to 0.4-0.5 s
    large = {"price_in": 1.25, "price_out": 10.0, "accuracy": 1.0, "latency_s": [8.0, 10.0], "output_tokens": 100}
    with start_service(
        {"experts": {"sleep": True, "sleep_scale": 0.05, "simulated": {"expert-large": large}}}
    ) as handle:
        yield handle.urls


@pytest.fixture(scope="module")
def chat():
    convo = [
        {"role": "system", "content": "You are an orchestrator."},
        {"role": "user", "content": FAST},
        tool_call_message("calculator", {"expression": "12 + 30"}),
        {"role": "tool", "content": "42"},
        tool_call_message("answer", {"answer": "42"}),
    ]
    return ChatFormat(build_embedded_tokenizer([render_chat(QWEN3_CHAT_TEMPLATE, convo, [])] * 4, vocab_size=600))


class ScriptedEngine:
    """Calls the slow expert for SLOW tasks and the calculator for FAST ones, then answers.

    Turns are encoded one character per token where possible, a split the tokenizer itself never
    produces, so a rollout that re-tokenized text would not reproduce these ids."""

    def __init__(self, chat: ChatFormat):
        self.chat, self.calls, self.lock = chat, [], threading.Lock()

    def _ids(self, text: str) -> list[int]:
        parts = re.split(r"(</?tool_call>)", text)
        return [
            i for part in parts for piece in ([part] if "tool_call>" in part else part) for i in self.chat.encode(piece)
        ]

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop_ids, seeds=None):
        assert self.lock.acquire(blocking=False), "generate called concurrently"
        try:
            out = []
            for p in prompts:
                text = self.chat.decode(p)
                slow = SLOW in text
                if "<tool_response>" in text:
                    call = format_tool_call("answer", {"answer": "42"})
                elif slow:
                    call = format_tool_call("expert", {"model": "expert-large", "query": SLOW})
                else:
                    call = format_tool_call("calculator", {"expression": "12 + 30"})
                ids = self._ids(call) + [stop_ids[0]]
                out.append(Generation(ids, [-0.5] * len(ids), True))
                self.calls.append((time.perf_counter(), slow, "<tool_response>" in text))
            time.sleep(0.02)
            return out
        finally:
            self.lock.release()


def _task(problem, category):
    return TaskRecord(problem=problem, answer="42", category=category, tools=["calculator", "expert", "answer"])


def test_token_ids_are_prompt_plus_generated_plus_observations(service, chat):
    engine = ScriptedEngine(chat)
    task = _task(FAST, "arithmetic")
    client = ToolsEnvClient(service)

    async def go():
        try:
            tools = (await client.create_episode(task.to_dict()))["tools"]  # the schemas the prompt shows
            return tools, await run_rollouts([task], 2, engine, client, chat, _rollout_cfg(), reward_cfg())
        finally:
            await client.aclose()

    tools, trajs = asyncio.run(go())
    assert len(trajs) == 2
    for t in trajs:
        assert t.stop_reason == "answer" and t.correct and len(t.turns) == 2
        prompt = chat.prompt_ids(task_messages(with_default_preference(task, reward_cfg().default_preference)), tools)
        turn1 = engine._ids(format_tool_call("calculator", {"expression": "12 + 30"})) + [chat.end_of_turn_id]
        obs = chat.encode(chat.observation_suffix("42"))
        turn2 = engine._ids(format_tool_call("answer", {"answer": "42"})) + [chat.end_of_turn_id]
        assert turn1 != chat.encode(format_tool_call("calculator", {"expression": "12 + 30"})) + [chat.end_of_turn_id]
        assert t.token_ids == prompt + turn1 + obs + turn2
        assert t.loss_mask == [0] * len(prompt) + [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
        assert t.gen_logprobs == [0.0] * len(prompt) + [-0.5] * len(turn1) + [0.0] * len(obs) + [-0.5] * len(turn2)


def test_generation_overlaps_slow_tool_calls(service, chat):
    """The fast trajectories generate their answer turn while the slow expert call is in flight."""
    engine = ScriptedEngine(chat)
    client = ToolsEnvClient(service)
    stats = {}

    async def go():
        try:
            return await run_rollouts(
                [_task(SLOW, "reasoning"), _task(FAST, "arithmetic")],
                2,
                engine,
                client,
                chat,
                _rollout_cfg(),
                reward_cfg(),
                stats=stats,
            )
        finally:
            await client.aclose()

    trajs = asyncio.run(go())
    assert all(t.stop_reason == "answer" and len(t.turns) == 2 for t in trajs)
    fast_answer = max(t for t, slow, second in engine.calls if not slow and second)
    slow_answer = min(t for t, slow, second in engine.calls if slow and second)
    slow_call_latency = min(t.latency_s for t in trajs if SLOW in t.task.problem) * 0.05
    assert slow_answer - fast_answer > 0.5 * slow_call_latency  # lockstep turns would generate them together
    assert stats["generate_calls"] >= 3 and stats["generate_s"] > 0 and stats["env_wait_s"] > 0.2
