"""Published chat templates (tests/fixtures/chat_templates: Qwen3's, thinking on and off, and
Qwen2.5-Instruct's) as a user's tokenizer carries them: the probe finds where each would make what is
served differ from what is trained, the run adopts the prefix-preserving template that renders the
same first prompt, and through ``run_episodes`` every turn's prompt ids equal what the exported
tokenizer's template (``transformers``' ``apply_chat_template``, what vLLM's OpenAI server runs)
renders for the messages so far, for reasoning, empty think blocks, several calls in one turn, several
tool turns and a BFCL entry with several user turns."""

from __future__ import annotations

import asyncio
import copy
import logging
import os

import pytest

from nemo_orchestra.data.default_tasks import generate_tasks
from nemo_orchestra.prompting.chat import (
    END_OF_TURN,
    PREFIX_QWEN3_TEMPLATE,
    ChatFormat,
    ChatTemplateError,
    _as_served,
    format_tool_call,
    probe_problems,
    render_chat,
    resolve_chat_format,
    tool_call_message,
)
from nemo_orchestra.prompting.prompts import task_messages, with_default_preference
from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer
from nemo_orchestra.rollout.loop import LoopLimits, Turn, run_episodes
from nemo_orchestra.types import Trajectory
from tools_env.client import ToolsEnvClient
from tools_env.supervisor import start_service

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "chat_templates")
PREFERENCE = {"accuracy": 1.0, "cost": 0.5, "latency": 0.5}


def published(name: str) -> str:
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()


QWEN3, QWEN25 = published("qwen3.jinja"), published("qwen2.5-instruct.jinja")
# (template, enable_thinking): the user's tokenizer as it comes
USERS = {
    "qwen3": (QWEN3, None),
    "qwen3-thinking": (QWEN3, True),
    "qwen3-no-thinking": (QWEN3, False),
    "qwen2.5-instruct": (QWEN25, None),
}


@pytest.fixture(scope="module")
def tokenizer():
    tasks = generate_tasks(30, 3)
    corpus = [render_chat(PREFIX_QWEN3_TEMPLATE, task_messages(with_default_preference(t, PREFERENCE))) for t in tasks]
    return build_embedded_tokenizer(corpus, vocab_size=700)


def user_tokenizer(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("thinking", [None, True, False])
def test_the_prefix_template_passes_the_probe(tokenizer, thinking):
    assert probe_problems(ChatFormat(tokenizer, PREFIX_QWEN3_TEMPLATE, thinking)) == []


@pytest.mark.parametrize(
    "user, cases",
    [
        # the empty think block is dropped once a tool message follows; reasoning before a second query too
        ("qwen3", {"an empty think block", "reasoning before a second user query", "a malformed turn"}),
        ("qwen3-thinking", {"an empty think block", "reasoning before a second user query"}),
        # the generation prompt's empty think block is never rendered back
        ("qwen3-no-thinking", {"a call without a plan", "several tool turns", "a malformed turn"}),
        # a newline always goes between the content and the call, and a server keeps it in the content
        ("qwen2.5-instruct", {"a plan, then a call", "a second user query"}),
    ],
)
def test_published_templates_fail_the_probe_where_they_rewrite_the_past(tokenizer, user, cases):
    template, thinking = USERS[user]
    failed = {p.split(":")[0] for p in probe_problems(ChatFormat(tokenizer, template, thinking))}
    assert cases <= failed, failed


@pytest.mark.parametrize("user", sorted(USERS))
def test_the_prefix_template_renders_the_published_first_prompt(tokenizer, user):
    """The model reads the prompt it was tuned on: the first prompt of real tasks (with and without the
    tool schemas) is the same string, rendered by transformers with the published template."""
    template, thinking = USERS[user]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    theirs = user_tokenizer(tokenizer, template)
    for task in generate_tasks(6, 5):
        messages = task_messages(with_default_preference(task, PREFERENCE))
        for offered in (tools, None):
            want = theirs.apply_chat_template(
                messages, tools=offered, add_generation_prompt=True, tokenize=False, **kwargs
            )
            assert render_chat(PREFIX_QWEN3_TEMPLATE, messages, offered, True, **kwargs) == want


@pytest.mark.parametrize("user", sorted(USERS))
def test_auto_adopts_the_prefix_template_and_tokenizer_refuses(tokenizer, user, caplog):
    template, thinking = USERS[user]
    tok = user_tokenizer(tokenizer, template)
    with caplog.at_level(logging.WARNING):
        chat = resolve_chat_format(tok, "auto", thinking)
    assert chat.template == PREFIX_QWEN3_TEMPLATE and chat.enable_thinking is thinking
    assert "prefix-preserving" in caplog.text
    with pytest.raises(ChatTemplateError, match=r"model\.chat_template=prefix") as e:
        resolve_chat_format(tok, "tokenizer", thinking)
    assert "cannot keep what is trained equal to what a server renders" in str(e.value)


def test_a_template_file_is_probed_and_a_foreign_first_prompt_is_refused(tokenizer, tmp_path):
    good, bad = tmp_path / "good.jinja", tmp_path / "bad.jinja"
    good.write_text(PREFIX_QWEN3_TEMPLATE)
    bad.write_text(QWEN25)
    assert resolve_chat_format(tokenizer, str(good)).template == PREFIX_QWEN3_TEMPLATE
    with pytest.raises(ChatTemplateError, match="bad.jinja cannot keep"):
        resolve_chat_format(tokenizer, str(bad))
    with pytest.raises(ChatTemplateError, match="cannot read"):
        resolve_chat_format(tokenizer, str(tmp_path / "missing.jinja"))
    # a template whose first prompt differs from the prefix template's is refused, not replaced
    foreign = user_tokenizer(tokenizer, QWEN25.replace("# Tools", "# Functions"))
    with pytest.raises(ChatTemplateError, match="renders its first prompt differently"):
        resolve_chat_format(foreign, "auto")


def test_the_template_writes_reasoning_as_qwen3_and_keeps_it(tokenizer):
    chat = ChatFormat(tokenizer, PREFIX_QWEN3_TEMPLATE)
    messages = [{"role": "user", "content": "q"}]
    reasoning = {**tool_call_message("f", {"a": 1}), "reasoning_content": "plan"}
    assert (
        chat.turn_text(messages, reasoning)
        == '<think>\nplan\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    # Qwen3's own template writes the same turn, but drops it from the past once a tool result follows
    qwen3 = ChatFormat(tokenizer, QWEN3)
    assert qwen3.turn_text(messages, reasoning) == chat.turn_text(messages, reasoning)
    empty = {**tool_call_message("f", {"a": 1}), "reasoning_content": ""}
    history = messages + [empty, {"role": "tool", "content": "1"}]
    assert "<think>\n\n</think>" in chat.render(history) and "<think>" not in qwen3.render(history)


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
        assert t.stop_reason == "answer" and t.correct and t.turns == 4
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
    """Without a reasoning parser (the README's serve command) the think block is content, rendered verbatim:
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


def test_a_server_reply_is_kept_whole():
    """What an OpenAI-compatible server returns — content, reasoning (``reasoning`` as vLLM names it),
    every tool call — is the message the conversation continues with."""
    from nemo_orchestra.prompting.chat import parse_server_message

    reply = {
        "role": "assistant",
        "content": "Two checks.\n",
        "reasoning": "I add.",
        "tool_calls": [
            {
                "id": "chatcmpl-tool-1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression":"1+1"}'},
            },
            {
                "id": "chatcmpl-tool-2",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "2"}},
            },
        ],
    }
    parsed = parse_server_message(reply)
    assert parsed.error is None and [c.arguments for c in parsed.calls] == [{"expression": "1+1"}, {"expression": "2"}]
    assert parsed.message["reasoning_content"] == "I add." and parsed.message["content"] == "Two checks.\n"
    assert [tc["id"] for tc in parsed.message["tool_calls"]] == ["call_0", "call_1"]  # not the server's random ids
    assert parsed.message["tool_calls"][0]["function"]["arguments"] == '{"expression": "1+1"}'  # as the parser writes
    # a server without a tool parser: the calls are read from the text, the think block stays in the content
    text = "<think>\nhm\n</think>\n\n" + format_tool_call("answer", {"answer": "7"})
    plain = parse_server_message({"content": text})
    assert plain.calls[0].name == "answer" and plain.message["content"] == "<think>\nhm\n</think>\n\n"
    assert "reasoning_content" not in plain.message
    # arguments that are not a JSON object: a format error naming them, the call left in the text
    bad = parse_server_message({"content": "", "tool_calls": [{"function": {"name": "answer", "arguments": "[1]"}}]})
    assert bad.calls == [] and "JSON object" in bad.error and "<tool_call>" in bad.message["content"]
    assert parse_server_message({"content": "just text"}).error == "no <tool_call>...</tool_call> in the turn"
    for entry in ("answer", {"function": "answer"}, {"function": {"arguments": "{}"}}):  # not a call: no crash
        odd = parse_server_message({"content": "", "tool_calls": [entry]})
        assert odd.calls == [] and odd.error


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


def test_a_request_carries_reasoning_under_both_names():
    from nemo_orchestra.prompting.chat import request_messages

    messages = [{"role": "user", "content": "q"}, {**tool_call_message("f", {}), "reasoning_content": "r"}]
    sent = request_messages(messages)
    assert sent[1]["reasoning"] == sent[1]["reasoning_content"] == "r" and sent[0] == messages[0]
    assert "reasoning" not in messages[1]  # the episode's own messages are left as they are
