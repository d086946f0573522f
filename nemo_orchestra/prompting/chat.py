"""Chat format: Qwen3's template (system/user/assistant/tool roles, ``<tool_call>`` JSON calls).

The template below is the subset of Qwen3's chat template that orchestration uses, so the
embedded tokenizer and a real Qwen3 tokenizer render the same strings. Rollouts never
re-tokenize a conversation: the prompt is encoded once, generated ids are kept as they are,
and each observation is encoded alone as the *suffix* the template adds for a tool message
(``observation_suffix``), which is appended after the generated ``<|im_end|>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- if (loop.first and message.content and not message.content.endswith('\\n')) or not loop.first %}"
    "{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{%- if tc.function.arguments is string %}{{- tc.function.arguments }}"
    "{%- else %}{{- tc.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
END_OF_TURN = "<|im_end|>"

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolCallParseError(ValueError):
    pass


def parse_tool_call(text: str) -> ToolCall:
    """The first ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in a turn."""
    m = _TOOL_CALL_RE.search(text)
    if m is None:
        raise ToolCallParseError("no <tool_call>...</tool_call> in the turn")
    try:
        obj = json.loads(m.group(1))
    except json.JSONDecodeError as e:
        raise ToolCallParseError(f"tool call is not valid JSON: {e.msg}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallParseError('tool call must be {"name": str, "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some servers and models encode the arguments as a JSON string
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as e:
            raise ToolCallParseError(f"tool call arguments are not valid JSON: {e.msg}") from None
    if not isinstance(args, dict):
        raise ToolCallParseError("tool call arguments must be a JSON object")
    return ToolCall(obj["name"], args)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The assistant turn text for one call, as the template renders it (without ``<|im_end|>``)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def tool_call_message(
    name: str, arguments: dict[str, Any], content: str = "", call_id: str | None = None
) -> dict[str, Any]:
    """An assistant message with one call, as the OpenAI API has it (arguments as a JSON string).
    The template renders it as ``content`` followed by the ``<tool_call>`` block, on a new line
    unless ``content`` already ends one: exactly ``content + format_tool_call(name, arguments)``
    when ``content`` ends with a newline, which is how the orchestrator writes its turns."""
    call = {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
    if call_id is not None:
        call = {"id": call_id, **call}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def assistant_message(text: str, call: ToolCall | None, call_id: str | None = None) -> dict[str, Any]:
    """The OpenAI message for an assistant turn written as ``text``: its text before the call and the
    call itself when ``call`` was read from it, the whole text otherwise (a turn without a valid call)."""
    if call is None:
        return {"role": "assistant", "content": text}
    cut = text.find("<tool_call>")
    return tool_call_message(call.name, call.arguments, text[:cut] if cut >= 0 else text, call_id)


def tool_message(observation: str, call_id: str | None = None) -> dict[str, Any]:
    """What a tool (or the loop, for a turn without a valid call) answers; rendered as ``<tool_response>``."""
    return {"role": "tool", "content": observation, **({"tool_call_id": call_id} if call_id else {})}


def render_chat(template: str, messages, tools=None, add_generation_prompt: bool = False) -> str:
    """Render with the same Jinja semantics as ``transformers``' ``apply_chat_template``."""
    return _compile(template).render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)


_COMPILED: dict[str, Any] = {}


def _compile(template: str):
    if template not in _COMPILED:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        _COMPILED[template] = env.from_string(template)
    return _COMPILED[template]


class ChatFormat:
    """Renders prompts and observation suffixes with a tokenizer's chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)

    def render(self, messages, tools=None, add_generation_prompt=False) -> str:
        return render_chat(self.tokenizer.chat_template, messages, tools, add_generation_prompt)

    def prompt_ids(self, messages, tools) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def observation_suffix(self, observation: str) -> str:
        """Text the template puts between an assistant turn's ``<|im_end|>`` and the next generation.

        Computed as render(history + tool message + gen prompt) minus render(history), on a
        fixed one-call history, so it follows whatever template the tokenizer carries.
        """
        history = [{"role": "user", "content": "q"}, tool_call_message("f", {})]
        before = self.render(history)
        after = self.render(history + [{"role": "tool", "content": observation}], add_generation_prompt=True)
        assert after.startswith(before), "chat template does not render a conversation as a prefix"
        cut = before.rindex(END_OF_TURN) + len(END_OF_TURN)  # generation stops at <|im_end|>
        return after[cut:]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)
