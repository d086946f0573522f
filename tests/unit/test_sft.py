"""The scripted warm start's choices: valid for the tools each task offers, a clear error otherwise."""

import random

import pytest

from nemo_orchestra.sft import _choose, _final
from tests.unit.helpers import task


def _tool(name, **props):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


ALIASES = ["expert-small", "expert-large"]
ANSWER = _tool("answer", answer={"type": "string"}, model={"type": "string", "enum": ALIASES})


def test_choices_cover_every_usable_tool_and_only_those():
    t = task(category="arithmetic")
    t.problem = "What is 12 * 3?"
    tools = [_tool("calculator"), _tool("expert"), ANSWER]
    rng = random.Random(0)
    seen = {}
    for _ in range(200):
        name, args = _choose(t, tools, rng)
        seen[name] = args
    assert set(seen) == {"calculator", "expert", "answer"}
    assert seen["calculator"] == {"expression": "12 * 3"} and seen["answer"]["model"] in ALIASES
    assert seen["expert"]["query"] == t.problem
    t.problem = "What is the capital of Kalo?"  # no expression: never the calculator
    assert all(_choose(t, tools, rng)[0] != "calculator" for _ in range(100))


def test_without_writing_experts_the_final_answer_is_the_tool_result():
    tools = [_tool("calculator"), _tool("answer", answer={"type": "string"})]
    assert all(_final("42", tools, random.Random(i)) == {"answer": "42"} for i in range(20))


def test_a_task_with_nothing_usable_is_a_clear_error():
    t = task()
    with pytest.raises(ValueError, match=r"offers none of .* its tools: \['search', 'answer'\]"):
        _choose(t, [_tool("search"), _tool("answer", answer={"type": "string"})], random.Random(0))
