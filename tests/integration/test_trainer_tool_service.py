"""The trainer's episodes survive the tool service dying: ``Episodes.run`` restarts a service the
run started and redoes the batch, or stops in one line naming the service and how to resume."""

import asyncio
import os
import signal

import pytest

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
from nemo_orchestra.rollout.managed_engine import ManagedEngine
from nemo_orchestra.train.rollout_source import Episodes
from nemo_orchestra.types import StopReason
from tools_env.client import ToolsEnvClient
from tools_env.supervisor import start_service
from tools_env.recovery import ToolServiceDown
from tools_env.task import TaskRecord

ANSWER = format_tool_call("answer", {"answer": "42"})


@pytest.fixture(scope="module")
def chat():
    convo = [{"role": "user", "content": "What is 6 * 7?"}, tool_call_message("answer", {"answer": "42"})]
    return ChatFormat(build_embedded_tokenizer([render_chat(QWEN3_CHAT_TEMPLATE, convo, [])] * 4, vocab_size=600))


class KillingEngine:
    """Answers 42 at once; its first generate call kills the tool service first (SIGKILL, whole group)."""

    def __init__(self, chat, service):
        self.chat, self.service, self.calls = chat, service, 0

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop_ids, seeds=None):
        self.calls += 1
        if self.calls == 1:
            os.killpg(self.service.process.pid, signal.SIGKILL)
            self.service.process.wait(10)
        ids = self.chat.encode(ANSWER) + [self.chat.end_of_turn_id]
        return [Generation(ids, [0.0] * len(ids), True) for _ in prompts]


def episodes(chat, engine, client, tmp_path):
    cfg = load_config([f"run.output_dir={tmp_path}", "rollout.max_context=65536"])  # room for the tool schemas
    generation = ManagedEngine(engine=engine)
    loop = asyncio.new_event_loop()
    return Episodes(cfg.rollout, cfg.reward.default_preference, generation, chat, client, loop, str(tmp_path))


def test_episodes_restart_the_service_it_started_and_redoes_the_batch(chat, tmp_path):
    task = TaskRecord.from_dict(
        {"problem": "What is 6 * 7?", "answer": "42", "category": "arithmetic", "tools": ["calculator", "answer"]}
    )
    with start_service() as svc:
        engine = KillingEngine(chat, svc)
        t = episodes(chat, engine, ToolsEnvClient(svc.urls, service=svc), tmp_path)
        trajs = t.run([task], 2, 1.0, "s", step=2)
        assert svc.restarts == 1 and engine.calls == 2 and t.client.urls == svc.urls
        assert [(x.stop_reason, x.correct) for x in trajs] == [(StopReason.ANSWER, True)] * 2
        t.loop.run_until_complete(t.client.aclose())


def test_episodes_stop_in_one_line_when_the_service_is_not_its_own(chat, tmp_path):
    task = TaskRecord.from_dict(
        {"problem": "What is 6 * 7?", "answer": "42", "category": "arithmetic", "tools": ["answer"]}
    )
    with start_service() as svc:
        t = episodes(chat, KillingEngine(chat, svc), ToolsEnvClient(svc.urls), tmp_path)
        with pytest.raises(ToolServiceDown) as e:
            t.run([task], 2, 1.0, "s", step=2)
        t.loop.run_until_complete(t.client.aclose())
    line = str(e.value)
    assert "\n" not in line and f"tool service {svc.urls[0]} stopped answering during step 3's rollouts" in line
    assert f"resumes from the newest checkpoint in {tmp_path}/checkpoints" in line
