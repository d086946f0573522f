"""Published chat templates (tests/fixtures/chat_templates: Qwen3's, thinking on and off, and
Qwen2.5-Instruct's) as a user's tokenizer carries them: the probe finds where each would make what is
served differ from what is trained, the run adopts the prefix-preserving template that renders the
same first prompt, and through ``run_episodes`` every turn's prompt ids equal what the exported
tokenizer's template (``transformers``' ``apply_chat_template``, what vLLM's OpenAI server runs)
renders for the messages so far, for reasoning, empty think blocks, several calls in one turn, several
tool turns and a BFCL entry with several user turns."""

from __future__ import annotations

import copy
import logging
import os

import pytest

from nemo_orchestra.data.default_tasks import generate_tasks
from nemo_orchestra.prompting.chat import (
    PREFIX_QWEN3_TEMPLATE,
    ChatFormat,
    ChatTemplateError,
    format_tool_call,
    probe_problems,
    render_chat,
    resolve_chat_format,
    tool_call_message,
)
from nemo_orchestra.prompting.prompts import task_messages, with_default_preference
from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer

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


def test_a_request_carries_reasoning_under_both_names():
    from nemo_orchestra.prompting.chat import request_messages

    messages = [{"role": "user", "content": "q"}, {**tool_call_message("f", {}), "reasoning_content": "r"}]
    sent = request_messages(messages)
    assert sent[1]["reasoning"] == sent[1]["reasoning_content"] == "r" and sent[0] == messages[0]
    assert "reasoning" not in messages[1]  # the episode's own messages are left as they are
