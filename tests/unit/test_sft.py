"""The scripted warm start's choices: valid for the tools each task offers, a clear error otherwise."""

import random
import re

import pytest

from nemo_orchestra.data.warm_start import _choose, _final
from tests.helpers import task


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


def test_a_copy_lesson_calls_a_tool_whose_result_it_can_copy():
    t = task(category="arithmetic")
    t.problem = "What is 4821 * 37?"
    tools = [_tool("calculator"), _tool("expert"), ANSWER]
    assert {_choose(t, tools, random.Random(i), copy=True)[0] for i in range(50)} == {"calculator"}
    t.problem = "What is the capital of Kalo?"
    assert {_choose(t, tools, random.Random(i), copy=True)[0] for i in range(50)} == {"expert"}
    with pytest.raises(ValueError, match="offers none of"):
        _choose(t, [_tool("calculator"), ANSWER], random.Random(0), copy=True)


def test_without_writing_experts_the_final_answer_is_the_tool_result():
    tools = [_tool("calculator"), _tool("answer", answer={"type": "string"})]
    assert all(_final("42", tools, random.Random(i)) == {"answer": "42"} for i in range(20))


def test_a_task_with_nothing_usable_is_a_clear_error():
    t = task()
    with pytest.raises(ValueError, match=r"offers none of .* its tools: \['search', 'answer'\]"):
        _choose(t, [_tool("search"), _tool("answer", answer={"type": "string"})], random.Random(0))


def test_warm_start_lr_decays_along_a_cosine_to_its_floor():
    from nemo_orchestra.train.warm_start import cosine_lr

    lrs = [cosine_lr(3e-3, 0.1, i, 400) for i in range(400)]
    assert lrs[0] == pytest.approx(3e-3) and lrs[-1] == pytest.approx(3e-4)
    assert lrs[200] == pytest.approx(3e-4 + 0.5 * 2.7e-3, rel=1e-2)
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert cosine_lr(1e-3, 0.0, 0, 1) == pytest.approx(1e-3)  # one step: the peak


def test_warm_start_min_lr_ratio_outside_0_1_is_refused():
    from nemo_orchestra.config import load_config

    with pytest.raises(ValueError, match="warm_start.min_lr_ratio"):
        load_config(["warm_start.min_lr_ratio=1.5"])


def _episode(copy: bool):
    from nemo_orchestra.data.warm_start import ScriptedEpisode

    t = task(category="arithmetic")
    t.problem, t.answer, t.meta = "What is 4821 * 37?", "178377", {"preference_name": "cost_sensitive"}
    tools = [_tool("calculator", expression={"type": "string"}), ANSWER]
    turns = [("calculator", {"expression": "4821 * 37"}, "178377"), ("answer", {"answer": "178377"}, "correct")]
    return ScriptedEpisode(t, tools, turns, copy=copy)


def test_copy_lessons_train_the_calls_but_not_the_plans():
    """A copy lesson's loss covers the calls (the expression copied from the problem, the result copied
    into the answer) and none of its plan tokens, so it adds copies without moving the choice of action;
    a scripted episode trains its plans as well. The lesson's prompt leaves out the tool schemas."""
    from nemo_orchestra.config import load_config
    from nemo_orchestra.data.default_tasks import plan_phrases, plan_text
    from nemo_orchestra.data.warm_start import render_text, to_trajectory
    from nemo_orchestra.prompting.chat import QWEN3_CHAT_TEMPLATE, ChatFormat
    from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer

    reward = load_config([]).reward
    corpus = [render_text(_episode(False), QWEN3_CHAT_TEMPLATE, reward)] * 4
    chat = ChatFormat(build_embedded_tokenizer(corpus, vocab_size=500, phrases=plan_phrases()))
    lesson, scripted = to_trajectory(_episode(True), chat, reward), to_trajectory(_episode(False), chat, reward)
    assert lesson.token_ids[lesson.prompt_len :] == scripted.token_ids[scripted.prompt_len :]
    assert lesson.prompt_len < scripted.prompt_len / 2  # no tool schemas in a lesson's prompt
    trained = lambda t: chat.decode([i for i, m in zip(t.token_ids, t.loss_mask) if m])  # noqa: E731
    assert "<think>" in trained(scripted) and "arithmetic, cheap: calculator" in trained(scripted)
    assert "<think>" not in trained(lesson) and "cheap" not in trained(lesson)
    assert '"expression": "4821 * 37"' in trained(lesson) and '"answer": "178377"' in trained(lesson)
    plans = [plan_text("arithmetic", "cost_sensitive", n, a) for n, a, _ in _episode(True).turns]
    masks = zip(lesson.loss_mask[lesson.prompt_len :], scripted.loss_mask[scripted.prompt_len :])
    assert all(b or not a for a, b in masks)
    assert sum(scripted.loss_mask) - sum(lesson.loss_mask) == sum(len(chat.encode(p)) for p in plans)


def test_copy_tasks_vary_the_length_of_what_is_copied():
    from nemo_orchestra.data.default_tasks import CATEGORIES, copy_tasks

    tasks = copy_tasks(600, seed=5)
    assert [t.category for t in tasks[:3]] == list(CATEGORIES[:3]) and len({t.id for t in tasks}) == 600
    arithmetic = [t for t in tasks if t.category == "arithmetic"]
    lengths = {len(t.answer) for t in arithmetic}
    assert min(lengths) == 1 and max(lengths) >= 7 and any(t.answer.startswith("-") for t in tasks)
    assert all("calculator" in t.tools for t in arithmetic)
    # two thirds keep the default set's operands, so its negatives and 4-digit products are copied as
    # often as the held-out tasks have them; half of those have a repdigit operand (11 to 99), where a
    # copy by "what followed this token" has two candidates
    operands = [tuple(map(int, re.match(r"What is (\d+) [-+*] (\d+)\?", t.problem).groups())) for t in arithmetic]
    default_shaped = [(t, a, b) for t, (a, b) in zip(arithmetic, operands) if 10 <= a <= 99 and 2 <= b <= 99]
    assert len(default_shaped) >= 2 * len(arithmetic) // 3
    assert sum(t.answer.startswith("-") for t, _, _ in default_shaped) >= 10
    assert sum(len(t.answer) == 4 and t.answer[0] != "-" for t, _, _ in default_shaped) >= 10
    repdigit = [t for t, a, b in default_shaped if any(x > 9 and x % 11 == 0 for x in (a, b))]
    assert len(repdigit) >= len(arithmetic) // 3
    assert {t.problem.split()[3] for t in repdigit} == {"+", "-", "*"}


def test_copy_lessons_with_a_task_file_are_refused_naming_the_key():
    from nemo_orchestra.config import load_config

    with pytest.raises(ValueError, match="warm_start.copy_lessons.*data.train_path"):
        load_config(["warm_start.copy_lessons=64", "data.train_path=tasks.jsonl"])
    assert load_config(["warm_start.copy_lessons=0", "data.train_path=tasks.jsonl"]).warm_start.copy_lessons == 0


def test_copy_lessons_by_default_only_with_the_embedded_task_set():
    from nemo_orchestra.config import load_config

    cfg = load_config(["warm_start.copy_lessons=null"])
    assert (
        cfg.warm_start.copy_lesson_count(None) == cfg.warm_start.steps * cfg.warm_start.copy_lessons_per_step
    )  # as many as it draws
    assert (
        load_config(["warm_start.copy_lessons=null", "warm_start.steps=10"]).warm_start.copy_lesson_count(None)
        == 10 * cfg.warm_start.copy_lessons_per_step
    )
    with_file = load_config(["warm_start.copy_lessons=null", "data.train_path=tasks.jsonl"])
    assert with_file.warm_start.copy_lesson_count(with_file.data.train_path) == 0
    assert (
        load_config(["warm_start.copy_lessons=5000", "warm_start.steps=10"]).warm_start.copy_lesson_count(None)
        == 10 * cfg.warm_start.copy_lessons_per_step
    )
    assert (
        load_config(
            ["warm_start.copy_lessons=null", "warm_start.copy_lessons_per_step=0"]
        ).warm_start.copy_lesson_count(None)
        == 0
    )
    with pytest.raises(ValueError, match="warm_start.copy_lessons"):
        load_config(["warm_start.copy_lessons=-1"])


@pytest.mark.parametrize("reasoning_parser", [False, True])
def test_scripted_turns_are_written_as_the_serving_server_reads_them(reasoning_parser):
    """Served without a reasoning parser, a plan is content written as ``<think>plan</think>\\n``; with one,
    it is reasoning, written as Qwen3 writes a think block, which the parser splits and the template writes
    back. Either way each scripted turn stays a prefix of the conversation's rendering (``Transcript``)."""
    from nemo_orchestra.config import load_config
    from nemo_orchestra.data.default_tasks import plan_phrases
    from nemo_orchestra.data.warm_start import render_text, to_trajectory
    from nemo_orchestra.prompting.chat import QWEN3_CHAT_TEMPLATE, ChatFormat
    from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer

    reward = load_config([]).reward
    corpus = [render_text(_episode(False), QWEN3_CHAT_TEMPLATE, reward)] * 4
    tok = build_embedded_tokenizer(corpus, vocab_size=500, phrases=plan_phrases())
    chat = ChatFormat(tok, reasoning_parser=reasoning_parser)
    text = chat.decode(to_trajectory(_episode(False), chat, reward).token_ids)
    plan = (
        "<think>\narithmetic, cheap: calculator\n</think>\n\n"
        if reasoning_parser
        else "<think>arithmetic, cheap: calculator</think>\n"
    )
    assert plan + "<tool_call>" in text


def test_no_scripted_choice_calls_a_paid_expert():
    """Aliases a real endpoint serves (their description lacks "(simulated)") are never called, as an
    expert or as the writer of the answer; a task left with nothing usable says which it would not call."""
    from nemo_orchestra.data.warm_start import paid_aliases

    expert = _tool("expert", model={"type": "string", "enum": ALIASES})
    expert["function"]["description"] = "| alias | $ in |\n| expert-small (simulated) | 0.2 |\n| expert-large | 1.25 |"
    tools = [expert, ANSWER]
    paid = paid_aliases(tools)
    assert paid == {"expert-large"}
    t = task(category="lookup")
    called = set()
    for i in range(200):
        rng = random.Random(i)
        name, args = _choose(t, tools, rng, avoid=paid)
        called.add(args.get("model"))
        called.add(_final("The answer is 3.", tools, rng, avoid=paid).get("model"))
    assert called == {"expert-small", None}  # None: answered with what the tool said
    with pytest.raises(ValueError, match=r"experts it does not call .*'expert-large', 'expert-small'"):
        _choose(t, tools, random.Random(0), avoid=frozenset(ALIASES))


MULTISTEP_TOOLS = [_tool("search", query={"type": "string"}), _tool("calculator"), _tool("expert"), ANSWER]


def _multistep_task():
    t = task(category="multistep")
    t.problem, t.answer = "How many years after the founding of Reta was Bremia Labs founded?", "785"
    t.meta = {"preference_name": "cost_sensitive"}
    return t


def test_a_multi_step_task_offers_the_chain_beside_the_experts_and_no_copy_lesson_takes_it():
    t = _multistep_task()
    seen = {_choose(t, MULTISTEP_TOOLS, random.Random(i))[0] for i in range(100)}
    assert seen == {"search", "expert", "answer"}  # no expression in the question: never the calculator first
    firsts = [_choose(t, MULTISTEP_TOOLS, random.Random(i)) for i in range(100)]
    searches = [args for name, args in firsts if name == "search"]
    assert all(set(args) == {"model"} and args["model"] in ALIASES for args in searches)
    assert len({args["model"] for args in searches}) > 1  # which expert writes the query is left at even odds
    assert {_choose(t, MULTISTEP_TOOLS, random.Random(i), copy=True)[0] for i in range(20)} == {"expert"}


def test_the_chain_has_an_expert_write_each_search_and_then_the_answer():
    from nemo_orchestra.data.warm_start import chain_call

    t = _multistep_task()
    city = "[city-0001] Reta: Reta is a city in Thadisstan, founded in 1164 on the banks of the Tavor river."
    company = "[company-0200] Bremia Labs: ... It was founded in 1949 by Kaex Dou and is headquartered in Reta."
    assert chain_call(t, [], "s", "l") == ("search", {"model": "s"})  # the expert writes each entity's query
    assert chain_call(t, [city], "s", "l") == ("search", {"model": "s"})
    assert chain_call(t, [city, company], "s", "l") == ("answer", {"model": "l"})  # and another the answer
