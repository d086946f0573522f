"""A task's own instructions (``TaskRecord.system``, a tau2 domain's policy) reach the policy in the
system message, after the orchestrator's system prompt, through the one function every path builds
its prompt with; a record without them reads and writes as before."""

from __future__ import annotations

import os

import pytest

from nemo_orchestra.evaluation.policies import FixedRouting
from nemo_orchestra.prompting.chat import render_chat
from nemo_orchestra.prompting.prompts import SYSTEM_PROMPT, task_messages
from tools_env.schema import task_record_schema
from tools_env.task import TaskRecord, TaskRecordError

QWEN3 = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "chat_templates", "qwen3.jinja"
)
BASE = {"problem": "Where is my order?", "answer": "", "category": "support", "tools": ["answer"]}
POLICY = "Refunds go to the original payment method only."


def test_the_system_message_carries_the_tasks_instructions_after_the_orchestrators():
    task = TaskRecord.from_dict({**BASE, "system": POLICY, "preference": {"accuracy": 1.0}})
    system, user = task_messages(task)
    assert system == {"role": "system", "content": f"{SYSTEM_PROMPT}\n\n{POLICY}"}
    assert user["role"] == "user" and user["content"].startswith(BASE["problem"]) and POLICY not in user["content"]
    plain = task_messages(TaskRecord.from_dict({**BASE, "preference": {"accuracy": 1.0}}))
    assert plain[0]["content"] == SYSTEM_PROMPT and plain[1] == user


def test_a_published_template_renders_the_instructions_in_the_system_block():
    with open(QWEN3) as f:
        template = f.read()
    text = render_chat(template, task_messages(TaskRecord.from_dict({**BASE, "system": POLICY})))
    system_block = text.split("<|im_start|>user")[0]
    assert SYSTEM_PROMPT in system_block and POLICY in system_block


def test_a_record_without_instructions_leaves_the_field_out_and_both_round_trip():
    plain = TaskRecord.from_dict(BASE)
    assert plain.system is None and "system" not in plain.to_dict()
    assert TaskRecord.from_dict(plain.to_dict()) == plain
    told = TaskRecord.from_dict({**BASE, "system": POLICY})
    assert told.to_dict()["system"] == POLICY and TaskRecord.from_dict(told.to_dict()) == told
    assert TaskRecord.from_dict({**BASE, "system": None}).system is None


def test_instructions_that_are_not_a_string_are_refused_by_name():
    with pytest.raises(TaskRecordError, match="system"):
        TaskRecord.from_dict({**BASE, "system": ["not", "text"]})
    assert task_record_schema()["properties"]["system"]["type"] == "string"


def test_a_fixed_routing_baseline_asks_its_expert_with_the_instructions():
    from nemo_orchestra.rollout.loop import Episode
    from nemo_orchestra.types import Trajectory

    task = TaskRecord.from_dict({**BASE, "tools": ["expert", "answer"], "system": POLICY})
    expert = {"function": {"name": "expert", "parameters": {"properties": {"model": {"enum": ["m"]}}}}}
    ep = Episode(task, 0, 0, "e", [expert], task_messages(task), Trajectory(task, 0, [], [], [], 0))
    call = FixedRouting("ask", lambda inp: "m").decide(ep)
    assert call.arguments["query"] == f"{POLICY}\n\n{BASE['problem']}"


def test_tau2_records_carry_the_domain_policy_as_instructions_not_as_the_problem():
    pytest.importorskip("tau2")
    from tools_env.domains.tau2.episode import environment
    from tools_env.domains.tau2.importer import CONVERSATION_NOTE, read_tasks, to_record
    from tools_env.domains.tau2.tools import service_name

    env = environment("retail")
    policy = env.get_policy()
    tools = [service_name("retail", t.name) for t in env.get_tools()]
    record = to_record(read_tasks("retail", "test")[0], "retail", "test", policy, tools)
    assert f"<policy>\n{policy}\n</policy>" in record.system and record.system.startswith("<instructions>")
    assert record.problem == CONVERSATION_NOTE
    assert TaskRecord.from_dict(record.to_dict()) == record
    system, user = task_messages(record)
    assert policy in system["content"] and policy not in user["content"]
