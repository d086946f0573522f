"""``call_prefix.first_break``: where a turn leaves every well-formed turn. The malformed texts below are turns
the default run's policy wrote (training samples, seeds 2 to 16 at 140 steps), each with the character that broke it."""

import pytest

from nemo_orchestra.prompting.call_prefix import first_break
from nemo_orchestra.prompting.chat import format_tool_call

ALIASES = ["expert-small", "expert-medium", "expert-large"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "answer",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string"}, "model": {"type": "string", "enum": ALIASES}},
                "required": [],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "expert",
            "parameters": {
                "type": "object",
                "properties": {"model": {"type": "string", "enum": ALIASES}, "query": {"type": "string"}},
                "required": ["model", "query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": []},
        },
    },
]
PLAN = "<think>puzzle, cheap: answer</think>\n"
CALL = '<tool_call>\n{"name": '


@pytest.mark.parametrize(
    "text, broken_at",
    [
        # the key left out: the copied word where a key of answer's goes
        (PLAN + CALL + '"answer", "arguments": {"T"}}\n</tool_call>', 'T"}}'),
        (PLAN + CALL + '"answer", "arguments": {"�bel"}}\n</tool_call>', "�bel"),
        # a second key's name written as the value's text, then a colon
        (PLAN + CALL + '"answer", "arguments": {"answer": "query": "Mine"}}\n</tool_call>', ': "Mine'),
        # an argument the tool does not take (the call parses: a schema error)
        (PLAN + CALL + '"expert", "arguments": {"expression": "94 * 68"}}\n</tool_call>', 'expression"'),
        (PLAN + CALL + '"calculator", "arguments": {"model": "expert-large"}}\n</tool_call>', 'model"'),
        # an alias run on into the query
        (PLAN + CALL + '"expert", "arguments": {"model": "expert-large18 riddles"}}\n</tool_call>', "18 riddles"),
        # a tool not offered
        (PLAN + CALL + '"search", "arguments": {}}\n</tool_call>', 'search"'),
        # a special token inside a string: a server's parsers cut the turn there
        (PLAN + CALL + '"calculator", "arguments": {"expression": "55 * </think>\n<tool_call>', "</think>\n<tool"),
        # a finished call, then a plan where its closing tag goes
        (PLAN + CALL + '"answer", "arguments": {"answer": "Te"}}\n<think>puzzle', "think>puzzle"),
        # an object where a string goes
        (PLAN + CALL + '"answer", "arguments": {"answer": {"x": 1}}}\n</tool_call>', '{"x"'),
        # text after the last call, and a plan holding a closing tag
        (PLAN + format_tool_call("answer", {"answer": "5"}) + "\nso 5", "so 5"),
        ("</tool_call>", "</tool_call>"),
        ("<think>x</think>\nthe answer is 42", "the answer"),
    ],
)
def test_the_break_is_the_first_character_no_well_formed_turn_has(text, broken_at):
    pos = first_break(text, TOOLS)
    assert text[pos:].startswith(broken_at), (text[:pos], text[pos:])
    assert first_break(text[:pos], TOOLS) in (pos, None)  # what came before is a well-formed turn or a prefix of one


@pytest.mark.parametrize(
    "text",
    [
        PLAN + format_tool_call("answer", {"answer": "Tevo"}),
        PLAN + format_tool_call("expert", {"model": "expert-large", "query": 'a "quoted" \\ word'}),
        PLAN
        + format_tool_call("calculator", {"expression": "2 + 3"})
        + "\n"
        + format_tool_call("answer", {"answer": "5"}),
        format_tool_call("answer", {"answer": "-48"}) + "\n",  # no plan; trailing white space
        "Adding them.\n" + format_tool_call("calculator", {"expression": "2 + 3"}),
    ],
)
def test_well_formed_turns_and_their_prefixes_do_not_break(text):
    assert first_break(text, TOOLS) is None
    for cut in range(len(text)):  # every proper prefix runs out inside a well-formed turn, or is one
        complete = text[:cut].rstrip().endswith("</tool_call>")
        assert first_break(text[:cut], TOOLS) == (None if complete else cut)


def test_without_offered_tools_any_json_call_is_well_formed():
    text = format_tool_call("lookup", {"city": "Tevo", "n": [1, 2.5e3, -4], "ok": True, "x": None})
    assert first_break(text, None) is None
    bare = text.replace(': "Tevo"', ": Tevo")
    assert bare[first_break(bare, None) :].startswith("Tevo")
    assert first_break(text, TOOLS) == text.index("lookup")  # offered tools: the name must be one of them
