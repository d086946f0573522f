import json

import pytest

from nemo_orchestra.prompting.chat import (
    QWEN3_CHAT_TEMPLATE,
    ChatFormat,
    ToolCallParseError,
    format_tool_call,
    parse_tool_call,
    render_chat,
    tool_call_message,
)
from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CONVO = [
    {"role": "system", "content": "You are an orchestrator."},
    {"role": "user", "content": "What is 2 + 3?"},
    tool_call_message("calculator", {"expression": "2 + 3"}),
    {"role": "tool", "content": "5"},
    tool_call_message("answer", {"answer": "5"}),
]


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [render_chat(QWEN3_CHAT_TEMPLATE, CONVO, TOOLS)] * 4
    return build_embedded_tokenizer(corpus, vocab_size=400)


def test_template_renders_qwen3_format():
    text = render_chat(QWEN3_CHAT_TEMPLATE, CONVO, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are an orchestrator.\n\n# Tools\n")
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" in text
    assert json.dumps(TOOLS[0]) in text


def test_our_renderer_equals_transformers_apply_chat_template(tokenizer):
    ours = render_chat(QWEN3_CHAT_TEMPLATE, CONVO, TOOLS, add_generation_prompt=True)
    theirs = tokenizer.apply_chat_template(CONVO, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ours == theirs


def test_special_tokens_are_single_ids(tokenizer):
    for tok in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>"):
        assert len(tokenizer.encode(tok, add_special_tokens=False)) == 1


@pytest.mark.parametrize("result", ["5", "-48"])
def test_incremental_ids_equal_tokenizing_the_whole_conversation(result):
    """prompt + turn + observation suffix + turn, encoded piecewise as a rollout builds them, are the ids
    of the full render encoded at once (what a server tokenizes), a negative result included."""
    convo = CONVO[:3] + [{"role": "tool", "content": result}, tool_call_message("answer", {"answer": result})]
    tokenizer = build_embedded_tokenizer([render_chat(QWEN3_CHAT_TEMPLATE, convo, TOOLS)] * 20, vocab_size=500)
    chat = ChatFormat(tokenizer)
    ids = chat.prompt_ids(convo[:2], TOOLS)
    ids += chat.encode(format_tool_call("calculator", {"expression": "2 + 3"})) + [chat.end_of_turn_id]
    ids += chat.encode(chat.observation_suffix(result))
    ids += chat.encode(format_tool_call("answer", {"answer": result})) + [chat.end_of_turn_id]
    full = chat.render(convo, TOOLS)
    assert chat.decode(ids) + "\n" == full
    assert ids + tokenizer.encode("\n", add_special_tokens=False) == tokenizer.encode(full, add_special_tokens=False)


def test_parse_tool_call():
    call = parse_tool_call(
        '<think>x</think><tool_call>\n{"name": "answer", "arguments": {"answer": "7"}}\n</tool_call>'
    )
    assert call.name == "answer" and call.arguments == {"answer": "7"}
    for bad in (
        "no call here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call>',
    ):
        with pytest.raises(ToolCallParseError):
            parse_tool_call(bad)


def test_plan_phrases_are_single_tokens_and_round_trip(tmp_path):
    """The embedded tokenizer keeps each plan ("<kind>, <label>: <action>") and expert alias whole,
    whatever BPE learned, so a tool choice is one token of its own per kind and preference; the
    text still decodes exactly, and the saved tokenizer encodes the same."""
    from transformers import AutoTokenizer

    from nemo_orchestra.data.default_tasks import EXPERT_PRICES, plan_phrases, plan_text

    turns = [
        plan_text(kind, pref, tool, args) + format_tool_call(tool, args)
        for kind in ("arithmetic", "lookup", "reasoning")
        for pref in ("cost_sensitive", "accuracy_first")
        for tool, args in (
            ("answer", {"model": "expert-small"}),
            ("expert", {"model": "expert-large", "query": "q"}),
            ("calculator", {"expression": "1 + 2"}),
            ("answer", {"answer": "3"}),
        )
    ]
    plain = build_embedded_tokenizer(turns * 10, vocab_size=400)
    tok = build_embedded_tokenizer(turns * 10, vocab_size=400, phrases=plan_phrases())
    assert len(tok) == len(plain) + len(plan_phrases())
    for phrase in plan_phrases():
        assert len(tok.encode(phrase, add_special_tokens=False)) == 1, phrase
    ids = tok.encode(
        plan_text("reasoning", "cost_sensitive", "answer", {"model": "expert-medium"}), add_special_tokens=False
    )
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[1:3] == ["puzzle, cheap: answer by expert-medium", "</think>"]
    head = tok.encode(plan_text("arithmetic", "accuracy_first", "answer", {"answer": "3"}), add_special_tokens=False)
    assert tok.decode([head[1]]) == "arithmetic, accurate: answer"  # not a prefix of "...: answer by ..."
    for text in turns:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    tok.save_pretrained(str(tmp_path))
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert all(again.encode(t, add_special_tokens=False) == tok.encode(t, add_special_tokens=False) for t in turns)
    assert set(EXPERT_PRICES) <= set(plan_phrases())


def test_a_negative_number_is_the_same_tokens_in_a_tool_result_and_in_an_answer(tmp_path):
    """The answer copies a tool result: "-48" must be the same tokens after "<tool_response>" as inside
    the answer's JSON string, however BPE merged the text before it (the sign is never merged into it);
    the expression's " - " operator stays a token apart from the sign. Saved and loaded, the same."""
    from transformers import AutoTokenizer

    corpus = [  # enough negative answers for BPE to merge a sign into the text before it, were it allowed
        render_chat(
            QWEN3_CHAT_TEMPLATE,
            [
                {"role": "user", "content": f"What is {a} - {a + 17}?"},
                tool_call_message("calculator", {"expression": f"{a} - {a + 17}"}),
                {"role": "tool", "content": "-17"},
                tool_call_message("answer", {"answer": "-17"}),
            ],
            TOOLS,
        )
        for a in range(10, 40)
    ]
    tok = build_embedded_tokenizer(corpus, vocab_size=600)
    tok.save_pretrained(str(tmp_path))
    for t in (tok, AutoTokenizer.from_pretrained(str(tmp_path))):
        number = t.encode("-48", add_special_tokens=False)
        assert [t.decode([i]) for i in number] == ["-", "4", "8"]
        for text in ("<tool_response>\n-48\n</tool_response>", format_tool_call("answer", {"answer": "-48"})):
            ids = t.encode(text, add_special_tokens=False)
            assert any(ids[i : i + 3] == number for i in range(len(ids))), [t.decode([i]) for i in ids]
        pieces = [p for p, _ in t.backend_tokenizer.pre_tokenizer.pre_tokenize_str("What is 36 - 84?")]
        assert pieces == ["WhatĠisĠ", "3", "6", "Ġ-Ġ", "8", "4", "?"]  # the operator: " - ", free to merge


@pytest.mark.parametrize(
    "text, plan",
    [
        (
            "<think>add them</think>\n" + format_tool_call("calculator", {"expression": "2 + 3"}),
            "<think>add them</think>\n",
        ),
        (
            '<think>add them</think>\n{"name": "calculator"}',
            "<think>add them</think>",
        ),  # no <tool_call>: through the plan
        ('{"name": "answer", "arguments": {"answer": "5"}}', ""),  # neither: no plan
        ("I add them.\n<tool_call>\n<tool_call>", "I add them.\n"),  # the first <tool_call> ends it
    ],
)
def test_plan_length_counts_the_ids_before_the_call(tokenizer, text, plan):
    """``ChatFormat.plan_length``: the ids of a turn's plan are the plan's own encoding, whatever follows."""
    chat = ChatFormat(tokenizer)
    ids = chat.encode(text)
    n = chat.plan_length(text, ids)
    assert ids[:n] == chat.encode(plan) and chat.decode(ids[:n]) == plan
    assert chat.plan_length(text, ids[: max(n - 1, 0)]) == max(n - 1, 0)  # never past the ids it is given
