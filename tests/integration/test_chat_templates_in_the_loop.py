"""Published chat templates in the agent loop, against the tool service: every turn is what the
exported template renders, a turn the template would rewrite is a format error kept verbatim, BFCL
entries are served as trained."""

# ruff: noqa: F811 (the tests take the shared ``tokenizer`` fixture by name)

from __future__ import annotations

import asyncio
import copy

import pytest

from nemo_orchestra.data.default_tasks import generate_tasks
from nemo_orchestra.prompting.chat import (
    END_OF_TURN,
    ChatFormat,
    _as_served,
    resolve_chat_format,
    tool_call_message,
)
from nemo_orchestra.rollout.loop import LoopLimits, Turn, run_episodes
from nemo_orchestra.types import Trajectory
from tests.unit.test_chat_templates import (  # noqa: F401 (tokenizer: the unit tests' fixture, shared)
    PREFERENCE,
    QWEN3,
    USERS,
    tokenizer,
    user_tokenizer,
)
from tools_env.client import ToolsEnvClient
from tools_env.supervisor import start_service


class Writer:
    """A token-level policy that writes each turn as the chat template writes its message (what a model
    trained on the template's turns writes), from ``decide(episode) -> (message, text or None)``; it
    records, for every turn, the episode's messages and the token ids it continues."""

    def __init__(self, chat: ChatFormat, decide):
        self.chat, self.decide, self.name, self.seen = chat, decide, "writer", []

    async def act(self, episodes):
        turns = []
        for ep in episodes:
            self.seen.append((copy.deepcopy(ep.messages), ep.tools, list(ep.traj.token_ids)))
            message, text = self.decide(ep)
            if text is None:
                text = self.chat.turn_text(ep.messages, message, ep.tools)
            ids = self.chat.encode(text) + [self.chat.end_of_turn_id]
            turns.append(Turn(text, ids, [-0.5] * len(ids), True, prompt_tokens=1, completion_tokens=len(ids)))
        return turns

    async def aclose(self):
        pass


def _call(name, args, content="", reasoning=None, *more):
    m = tool_call_message(name, args, content)
    for n, a in more:
        m["tool_calls"].append(tool_call_message(n, a)["tool_calls"][0])
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


def arithmetic_script(thinking):
    """Reasoning, then two calls in one turn; an empty think block; a plan; then the answer: four turns,
    three of them with tool results (several tool turns)."""
    think = (lambda r: r) if thinking is not False else (lambda r: None)

    def decide(ep):
        expr = ep.task.meta["expression"]
        return [
            (
                _call(
                    "calculator",
                    {"expression": expr},
                    "",
                    think("Two ways to check."),
                    ("calculator", {"expression": expr}),
                ),
                None,
            ),
            (_call("calculator", {"expression": expr}, "", think("")), None),
            (_call("calculator", {"expression": expr}, "Once more.\n", None), None),
            (_call("answer", {"answer": ep.task.answer}, "", think("Done.")), None),
        ][min(ep.turn, 3)]

    return decide


def _arithmetic_tasks(n):
    tasks = []
    for t in generate_tasks(40, 11):
        if t.category == "arithmetic" and "What is " in t.problem:
            t.meta["expression"] = t.problem.split("What is ", 1)[1].split("?")[0]
            tasks.append(t)
    return tasks[:n]


def exported_tokenizer(chat: ChatFormat, tokenizer, tmp_path):
    """The tokenizer as the run saves it and the export ships it: the chosen template in its files."""
    from transformers import AutoTokenizer

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = chat.template
    tok.save_pretrained(str(tmp_path))
    return AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)


def assert_every_turn_is_served_as_trained(writer: Writer, exported, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    assert writer.seen
    for messages, tools, ids in writer.seen:
        served = exported.apply_chat_template(
            _as_served(messages), tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )
        assert writer.chat.decode(ids) == served
        assert exported.encode(served, add_special_tokens=False) == ids


@pytest.fixture(scope="module")
def service():
    with start_service({}) as handle:
        yield handle.urls


def _run(tasks, policy, urls, max_turns=6) -> list[Trajectory]:
    async def go():
        client = ToolsEnvClient(urls)
        try:
            return await run_episodes(
                tasks, policy, client, limits=LoopLimits(max_turns=max_turns), default_preference=PREFERENCE
            )
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize("user", sorted(USERS))
def test_every_turn_is_what_the_exported_template_renders(tokenizer, service, tmp_path, user):
    template, thinking = USERS[user]
    chat = resolve_chat_format(user_tokenizer(tokenizer, template), "auto", thinking)
    writer = Writer(chat, arithmetic_script(thinking))
    trajs = _run(_arithmetic_tasks(3), writer, service)
    for t in trajs:
        assert t.stop_reason == "answer" and t.correct and len(t.turns) == 4
        assert t.format_errors == 0 and t.retokenized_turns == 0
        assert t.tool_counts.get("calculator") == 4  # both calls of the first turn ran
        assert [m["role"] for m in t.messages].count("tool") == 4
    assert_every_turn_is_served_as_trained(writer, exported_tokenizer(chat, tokenizer, tmp_path), thinking)
    # the whole trajectory is the rendering of its conversation, up to the last <|im_end|>
    exported = exported_tokenizer(chat, tokenizer, tmp_path)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    for t in trajs:
        tools = next(tools for messages, tools, _ in writer.seen if messages[:2] == t.messages[:2])
        full = exported.apply_chat_template(_as_served(t.messages), tools=tools, tokenize=False, **kwargs)
        assert chat.decode(t.token_ids) == full[: full.rindex(END_OF_TURN) + len(END_OF_TURN)]


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'


@pytest.mark.parametrize(
    "text, reasoning_parser, why",
    [
        ('<tool_call>\n{"name":"calculator","arguments":{"expression":"1 + 1"}}\n</tool_call>', False, "JSON spacing"),
        ("I add." + CALL, False, "no newline between the plan and the call"),
        (CALL + " trailing", False, "text after the call"),
        ("<think>plan</think>\n" + CALL, True, "a think block a reasoning parser reads back otherwise"),
    ],
)
def test_a_turn_the_template_would_rewrite_is_a_format_error_kept_verbatim(
    tokenizer, service, tmp_path, text, reasoning_parser, why
):
    """Counted as a format error (its call does not run), and the conversation keeps the text as written,
    so the next prompt is still what a server renders for the messages."""
    chat = resolve_chat_format(tokenizer, "prefix", reasoning_parser=reasoning_parser)
    task = _arithmetic_tasks(1)[0]
    answer = tool_call_message("answer", {"answer": task.answer})
    writer = Writer(chat, lambda ep: (None, text) if ep.turn == 0 else (answer, None))
    (t,) = _run([task], writer, service)
    assert t.format_errors == 1, why
    assert "calculator" not in t.tool_counts and t.correct
    assert t.messages[2] == {"role": "assistant", "content": text}
    assert_every_turn_is_served_as_trained(writer, exported_tokenizer(chat, tokenizer, tmp_path), None)


def test_a_think_block_is_kept_as_written_for_a_server_without_a_reasoning_parser(tokenizer, service):
    """Without a reasoning parser (the serve command of docs/checkpoints_and_export.md) the think block is content, rendered verbatim:
    the same turn runs its call."""
    chat = resolve_chat_format(tokenizer, "prefix")
    task = _arithmetic_tasks(1)[0]
    answer = tool_call_message("answer", {"answer": task.answer})
    writer = Writer(chat, lambda ep: (None, "<think>plan</think>\n" + CALL) if ep.turn == 0 else (answer, None))
    (t,) = _run([task], writer, service)
    assert t.format_errors == 0 and t.tool_counts.get("calculator") == 1
    assert t.messages[2]["content"] == "<think>plan</think>\n" and "reasoning_content" not in t.messages[2]


def test_a_bfcl_entry_with_several_user_turns_is_served_as_trained(tokenizer, tmp_path):
    """A BFCL multi-turn entry (its later user queries come back as the answer's observations), played
    by its ground truth written in the template's form, with Qwen3's published template as the user's."""
    pytest.importorskip("bfcl_eval", reason="BFCL tasks need the 'bfcl' extra")
    from tools_env.domains.bfcl.importer import read_category, to_record

    entries = [(e, gt) for e, gt in read_category("multi_turn_base")[:40] if len(gt) >= 3][:2]
    records = [to_record(e, gt, "multi_turn_base") for e, gt in entries]
    chat = resolve_chat_format(user_tokenizer(tokenizer, QWEN3), "auto", True)

    def decide(ep):
        actions = ep.task.gold_actions
        if ep.turn < len(actions):
            a = actions[ep.turn]
            return _call(a["name"], dict(a.get("arguments", {})), "", "Next step."), None
        return _call("answer", {"answer": "done"}, "", ""), None

    writer = Writer(chat, decide)
    with start_service({}) as handle:
        trajs = _run(records, writer, handle.urls, max_turns=60)
    for t, (_, gt) in zip(trajs, entries):
        assert t.correct and t.format_errors == 0, t.meta.get("episode")
        answers = [m for m in t.messages if m["role"] == "assistant" and "answer" in str(m.get("tool_calls"))]
        assert len(answers) == len(gt)  # one answer per user turn; each later user turn came as its observation
    assert_every_turn_is_served_as_trained(writer, exported_tokenizer(chat, tokenizer, tmp_path), True)


def test_the_chat_benchmark_plays_entries_without_format_errors(tmp_path):
    pytest.importorskip("bfcl_eval", reason="BFCL tasks need the 'bfcl' extra")
    import argparse
    import json

    from benchmarks import chat_templates

    out = tmp_path / "chat.json"
    assert chat_templates.main(argparse.Namespace(entries=4, out=str(out))) == 0
    report = json.loads(out.read_text())
    assert report["entries"] == report["correct"] == 4 and report["format_errors"] == 0
    assert report["tokens_per_turn_samples_mean"] > report["tokens_one_sequence_mean"] > 0
