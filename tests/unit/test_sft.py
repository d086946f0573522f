"""The scripted warm start's choices: valid for the tools each task offers, a clear error otherwise."""

import random

import pytest

from nemo_orchestra.data.warm_start import _choose, _final
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


def test_warm_start_lr_decays_along_a_cosine_to_its_floor():
    from nemo_orchestra.train.trainer import cosine_lr

    lrs = [cosine_lr(3e-3, 0.1, i, 400) for i in range(400)]
    assert lrs[0] == pytest.approx(3e-3) and lrs[-1] == pytest.approx(3e-4)
    assert lrs[200] == pytest.approx(3e-4 + 0.5 * 2.7e-3, rel=1e-2)
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert cosine_lr(1e-3, 0.0, 0, 1) == pytest.approx(1e-3)  # one step: the peak


def test_sft_min_lr_ratio_outside_0_1_is_refused():
    from nemo_orchestra.config import load_config

    with pytest.raises(ValueError, match="sft.min_lr_ratio"):
        load_config(["sft.min_lr_ratio=1.5"])
