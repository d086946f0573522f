"""Chat format: Qwen3-style chat templates (system/user/assistant/tool roles, ``<tool_call>`` JSON calls,
``<think>`` blocks), and the rule that keeps what is trained equal to what is served.

Rollouts never re-tokenize a conversation: the prompt is encoded once, generated ids are kept as
they are, and what the template adds after a turn (the tool results, the next generation prompt) is
encoded alone and appended after the generated ``<|im_end|>``. A server (vLLM's OpenAI server)
instead re-renders the whole conversation from messages at every turn. The two agree when the
template renders a conversation as a prefix of its continuation and renders each assistant message
as the model wrote it. ``Transcript`` enforces this turn by turn; ``ChatFormat.check`` probes a
template for it at load time over the cases an orchestrator meets (thinking on and off, empty think
blocks, several calls in one turn, several tool turns, a second user query, a malformed turn), and
``PREFIX_QWEN3_TEMPLATE`` is a Qwen3 template that passes (Qwen3's published one does not).

A turn the template would not render back as written (say, a call whose JSON is not in the
template's spacing, or no newline between the plan and the call) is a format error: its calls are
not run, and it stays in the conversation verbatim, so the token ids still equal the rendering.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# Qwen3's published chat template (Qwen/Qwen3-8B, tokenizer_config.json) with one change: every
# assistant message is rendered as the model wrote it, wherever it stands. The published template drops
# an empty think block once a tool message follows, drops all reasoning before the last user query, and
# renders a thinking-off turn without the ``<think>\n\n</think>\n\n`` its generation prompt added, so the
# conversation it renders for turn t+1 does not start with the one the model continued at turn t. This one
# renders the system, tools, user and tool messages and the generation prompt exactly as the published one
# (the first prompt is the same string), and an assistant message as
#   [<think>\n{reasoning_content stripped of newlines}\n</think>\n\n | the thinking-off block]
#   {content}[\n if content does not end one]<tool_call>\n{"name": N, "arguments": A}\n</tool_call>
#   (further calls each on a new line)<|im_end|>
# which is what a model writes and what vLLM's reasoning and hermes parsers split back into the same
# message. A message without ``reasoning_content`` renders its content verbatim (a server without a
# reasoning parser returns the think block inside the content).
PREFIX_QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set think_off = enable_thinking is defined and enable_thinking is false %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- set content = message.content or '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
            {%- set content = content.lstrip('\\n') %}
        {%- elif think_off %}
            {{- '<think>\\n\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content and not content.endswith('\\n')) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if think_off %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
QWEN3_CHAT_TEMPLATE = PREFIX_QWEN3_TEMPLATE  # the embedded tokenizer's

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


def tool_message(observation: str, call_id: str | None = None) -> dict[str, Any]:
    """What a tool (or the loop, for a turn without a valid call) answers; rendered as ``<tool_response>``."""
    return {"role": "tool", "content": observation, **({"tool_call_id": call_id} if call_id else {})}


def render_chat(template: str, messages, tools=None, add_generation_prompt: bool = False, **kwargs) -> str:
    """Render with the same Jinja semantics as ``transformers``' ``apply_chat_template`` and vLLM's
    server: tool-call arguments given as JSON strings (the OpenAI form) are passed as objects, and
    ``kwargs`` (``enable_thinking``) are the template's extra variables."""
    return _compile(template).render(
        messages=_as_served(messages), tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
    )


def request_messages(messages) -> list[dict[str, Any]]:
    """Messages as a request to an OpenAI-compatible server carries them: an assistant message's
    ``reasoning_content`` (what chat templates read) also as ``reasoning``, the field vLLM's server reads
    (its chat endpoint also takes the older name; its ``/tokenize`` reads only ``reasoning``)."""
    return [
        {**m, "reasoning": m["reasoning_content"]}
        if m.get("role") == "assistant" and m.get("reasoning_content") is not None
        else m
        for m in messages
    ]


def _as_served(messages):
    """Messages as vLLM's OpenAI server hands them to the template: each assistant tool call's
    ``arguments`` string parsed to an object (``_postprocess_messages``); other messages as they are."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = tc.get("function") or {}
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        pass
                calls.append({**tc, "function": {**fn, "arguments": args}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


_COMPILED: dict[str, Any] = {}


def _compile(template: str):
    if template not in _COMPILED:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        _COMPILED[template] = env.from_string(template)
    return _COMPILED[template]


class ChatTemplateError(ValueError):
    """A chat template that cannot keep the token ids a rollout keeps equal to what a server renders
    for the same messages; the message names the case, the place and the key that fixes it."""


@dataclass
class ParsedTurn:
    """An assistant turn as a server's parsers read it (vLLM's reasoning parser, then the hermes tool
    parser): the OpenAI message it becomes and its calls; ``error`` when it holds no valid call, and
    then ``message`` is the text verbatim."""

    message: dict[str, Any]
    calls: list[ToolCall]
    error: str | None = None


_CALL_BLOCK_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_turn(text: str, call_id: str = "call", split_reasoning: bool = True) -> ParsedTurn:
    """Split ``text`` as a server does: with ``split_reasoning`` (a reasoning parser) the reasoning before
    ``</think>`` (without ``<think>``) apart; content up to the first ``<tool_call>``, then every
    ``<tool_call>{"name", "arguments"}</tool_call>`` block (the hermes parser). Calls get ids
    ``{call_id}_{k}``; their arguments are re-serialized as the hermes parser re-serializes them."""
    body, reasoning = text, None
    if split_reasoning and "</think>" in text:
        head, _, body = text.partition("</think>")
        reasoning = head.split("<think>", 1)[1] if "<think>" in head else head
    start = body.find("<tool_call>")
    if start < 0:
        return ParsedTurn({"role": "assistant", "content": text}, [], "no <tool_call>...</tool_call> in the turn")
    calls = []
    for k, m in enumerate(_CALL_BLOCK_RE.finditer(body, start)):
        try:
            calls.append(parse_tool_call(m.group(0)))
        except ToolCallParseError as e:
            return ParsedTurn({"role": "assistant", "content": text}, [], str(e))
    if not calls:
        return ParsedTurn({"role": "assistant", "content": text}, [], "no <tool_call>...</tool_call> in the turn")
    message: dict[str, Any] = {
        "role": "assistant",
        "content": body[:start],
        "tool_calls": [
            {
                "id": f"{call_id}_{k}" if len(calls) > 1 else call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for k, c in enumerate(calls)
        ],
    }
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return ParsedTurn(message, calls)


def parse_server_message(message: dict[str, Any], call_id: str = "call") -> ParsedTurn:
    """An assistant message as an OpenAI-compatible server returned it: its tool calls as the server
    parsed them, its content, and its reasoning (``reasoning_content``, or
    ``reasoning`` as vLLM names it); without tool calls, its content read as ``parse_turn`` reads a
    turn (a server without a tool parser). A call whose name or arguments are not usable makes the
    turn malformed, the call written back into its text for the error to name."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    tool_calls = message.get("tool_calls") or []
    if not tool_calls:
        parsed = parse_turn(content, call_id, split_reasoning=False)
    else:
        calls, specs = [], []
        for k, tc in enumerate(tool_calls):
            fn = tc.get("function") if isinstance(tc, dict) else None
            fn = fn if isinstance(fn, dict) else {}  # an entry that is not a call: malformed, named below

            raw = fn.get("arguments", {})
            try:
                args = json.loads(raw or "{}") if isinstance(raw, str) else raw
            except json.JSONDecodeError:
                args = None
            if not isinstance(fn.get("name"), str) or not isinstance(args, dict):
                raw = raw if isinstance(raw, str) else json.dumps(raw)
                text = (
                    f'{content}<tool_call>\n{{"name": {json.dumps(fn.get("name"))}, "arguments": {raw}}}\n</tool_call>'
                )
                return parse_turn(text, call_id, split_reasoning=False)
            calls.append(ToolCall(fn["name"], args))
            specs.append(
                {  # the loop's own ids, as on every path: a server's are random, and a transcript is reproducible
                    "id": f"{call_id}_{k}" if len(tool_calls) > 1 else call_id,
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
        parsed = ParsedTurn({"role": "assistant", "content": content, "tool_calls": specs}, calls)
    if reasoning is not None:
        parsed.message["reasoning_content"] = reasoning
    return parsed


def first_difference(a: str, b: str, context: int = 40) -> str:
    """Where ``a`` and ``b`` part, with ``context`` characters of each around it."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(0, n - context)
    return f"at character {n}: {a[lo : n + context]!r} against {b[lo : n + context]!r}"


class ChatFormat:
    """Renders prompts and continuations with a chat template (the tokenizer's unless ``template``
    is given), with ``enable_thinking`` passed to the template when it is not None.
    ``reasoning_parser``: the server the model is served by splits reasoning off (vLLM's
    ``--reasoning-parser``), so turns are read as it reads them (``read_turn``)."""

    def __init__(
        self,
        tokenizer,
        template: str | None = None,
        enable_thinking: bool | None = None,
        reasoning_parser: bool = False,
    ):
        self.tokenizer = tokenizer
        self.template = template if template is not None else tokenizer.chat_template
        self.enable_thinking = enable_thinking
        self.reasoning_parser = reasoning_parser
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        self._vocabulary: list[str] | None = None  # each id's text, decoded once (tokens_starting)
        self._starting: dict[str, tuple[int, ...]] = {}

    def render(self, messages, tools=None, add_generation_prompt=False) -> str:
        return render_chat(self.template, messages, tools, add_generation_prompt, **self.template_kwargs)

    def prompt_ids(self, messages, tools) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def read_turn(self, text: str, call_id: str = "call") -> ParsedTurn:
        """A generated turn as the serving server reads it (``parse_turn``, with its reasoning split off
        when ``reasoning_parser``)."""
        return parse_turn(text, call_id, split_reasoning=self.reasoning_parser)

    def observation_suffix(self, observation: str) -> str:
        """Text the template puts between an assistant turn's ``<|im_end|>`` and the next generation,
        for one tool result after a one-call turn (``Transcript.observe`` computes it for any turn)."""
        history = [{"role": "user", "content": "q"}, tool_call_message("f", {})]
        transcript = Transcript(self, history[:1], None)
        transcript.assistant(history[:1], parse_turn(self.turn_text(history[:1], history[1])))
        return transcript.observe(history + [{"role": "tool", "content": observation}])

    def turn_text(self, messages, message, tools=None) -> str:
        """How the template writes assistant ``message`` after ``messages``: the text a policy generates
        for it (from the generation prompt to ``<|im_end|>``, exclusive)."""
        prompt = self.render(messages, tools, add_generation_prompt=True)
        full = self.render(list(messages) + [message], tools)
        end = full.rfind(END_OF_TURN)
        if not full.startswith(prompt) or end < len(prompt):
            raise ChatTemplateError(
                "the chat template does not render an assistant message as a continuation of its generation "
                f"prompt ({first_difference(full, prompt)})"
            )
        return full[len(prompt) : end]

    def check(self, source: str = "model.tokenizer's chat template") -> None:
        """Raise ``ChatTemplateError`` naming the first probe case whose rendering would differ from
        what a rollout keeps (``probe_problems``)."""
        problems = probe_problems(self)
        if problems:
            raise ChatTemplateError(
                f"{source} cannot keep what is trained equal to what a server renders: {problems[0]}"
                + (f" (and {len(problems) - 1} more case(s))" if len(problems) > 1 else "")
                + ". Set model.chat_template=prefix to train with nemo-orchestra's prefix-preserving Qwen3 "
                "template (the export ships it, so a server renders with it), or give a template file that passes."
            )

    def plan_length(self, text: str, ids: list[int]) -> int:
        """How many of a turn's ids (``ids``, written as ``text``) write its plan: the text before its first
        ``<tool_call>``, else through its ``</think>``, else none (a turn with neither has no plan). The ids the
        plan's own encoding shares with the turn's: a token that straddles the boundary counts as the call's."""
        if "<tool_call>" in text:
            head = text[: text.index("<tool_call>")]
        elif "</think>" in text:
            head = text[: text.index("</think>") + len("</think>")]
        else:
            return 0
        plan = self.encode(head)
        n = 0
        while n < min(len(plan), len(ids)) and plan[n] == ids[n]:
            n += 1
        return n

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokens_starting(self, prefix: str) -> tuple[int, ...]:
        """The ids of the vocabulary entries whose text starts with ``prefix`` (the vocabulary decoded once,
        each prefix's ids found once)."""
        if self._vocabulary is None:
            ids = [[i] for i in range(len(self.tokenizer))]
            self._vocabulary = self.tokenizer.batch_decode(ids, skip_special_tokens=False)
        if prefix not in self._starting:
            self._starting[prefix] = tuple(i for i, t in enumerate(self._vocabulary) if t.startswith(prefix))
        return self._starting[prefix]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


class Transcript:
    """The text of a token-level episode: the template's rendering of its messages so far, then what
    the policy wrote. Every turn keeps the rule that the next rendering starts with the text the policy
    continued, so the ids a rollout keeps (prompt, generated turns, the template's additions encoded
    alone) are the ids a server renders from the same messages."""

    def __init__(self, chat: ChatFormat, messages, tools):
        self.chat, self.tools = chat, tools
        self.text = chat.render(messages, tools, add_generation_prompt=True)

    def assistant(self, messages, parsed: ParsedTurn, text: str | None = None) -> ParsedTurn:
        """The turn to append after ``messages`` for what the policy wrote (``text``; the template's own
        writing of ``parsed.message`` when None): ``parsed`` when the template renders its message back as
        written; else the text verbatim, without calls, as a format error."""
        if text is None:
            text = self.chat.turn_text(messages, parsed.message, self.tools)
        written = self.text + text + END_OF_TURN
        error = parsed.error
        if error is None:  # a malformed turn is kept verbatim without rendering its message
            rendered = self.chat.render(list(messages) + [parsed.message], self.tools)
            if rendered.startswith(written):
                self.text = written
                return parsed
            error = "the turn is not written as the chat template writes it back " + (
                f"({first_difference(text + END_OF_TURN, rendered[len(self.text) :])})"
            )
        verbatim = ParsedTurn({"role": "assistant", "content": text}, [], error)
        again = self.chat.render(list(messages) + [verbatim.message], self.tools)
        if not again.startswith(written):
            raise ChatTemplateError(
                "the chat template does not render an assistant message's text verbatim "
                f"({first_difference(again[len(self.text) :], text + END_OF_TURN)})"
            )
        self.text = written
        return verbatim

    def observe(self, messages) -> str:
        """What the template adds after the last assistant turn for ``messages`` (which extend the
        conversation with tool results or a user query), up to the next generation prompt."""
        full = self.chat.render(messages, self.tools, add_generation_prompt=True)
        if not full.startswith(self.text):
            raise ChatTemplateError(
                "the chat template renders the conversation so far differently once it goes on "
                f"({first_difference(full, self.text)})"
            )
        suffix, self.text = full[len(self.text) :], full
        return suffix


def probe_problems(chat: ChatFormat) -> list[str]:
    """Each probe conversation whose rendering breaks the rule ``Transcript`` keeps, as one line. The
    assistant turns are written as the template writes them (``ChatFormat.turn_text``), read back as
    a server reads them (``parse_turn``), and the conversation goes on with tool results and, in one
    case, a second user query; the malformed turn must stay verbatim."""
    problems = []
    for name, (messages, tools) in _probe_cases(chat.enable_thinking).items():
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        try:
            transcript = Transcript(chat, messages[:first], tools)
            for i in range(first, len(messages)):
                m = messages[i]
                if m["role"] != "assistant":
                    continue
                if i > first:
                    transcript.observe(messages[:i])
                malformed = not m.get("tool_calls")
                text = m["content"] if malformed else chat.turn_text(messages[:i], m, tools)
                for split in (False, True):  # a server without and with a reasoning parser
                    before = transcript.text
                    got = transcript.assistant(messages[:i], parse_turn(text, split_reasoning=split), text)
                    if not malformed and got.error is not None:
                        server = "a server with a reasoning parser" if split else "a server"
                        raise ChatTemplateError(
                            f"the template writes turn {i} as {text!r}, which {server} reads back "
                            f"as a message the template writes otherwise: {got.error}"
                        )
                    if not split:
                        transcript.text = before
        except ChatTemplateError as e:
            problems.append(f"{name}: {e}")
    return problems


def _probe_cases(enable_thinking: bool | None) -> dict[str, tuple[list[dict], list[dict]]]:
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"the {name} tool",
                "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]},
            },
        }
        for name, arg in (("calculator", "expression"), ("answer", "answer"))
    ]
    system = {"role": "system", "content": "You are an orchestrator."}
    user = {"role": "user", "content": "What is 2 + 3?"}

    def call(*calls, content="", reasoning=None):
        m = {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"id": f"c{k}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                for k, (n, a) in enumerate(calls)
            ],
        }
        if reasoning is not None:
            m["reasoning_content"] = reasoning
        return m

    def result(text):
        return {"role": "tool", "content": text}

    add, answer = ("calculator", {"expression": "2 + 3"}), ("answer", {"answer": "5"})
    cases = {
        "a plan, then a call": [system, user, call(add, content="I add them.\n"), result("5"), call(answer)],
        "a call without a plan": [system, user, call(add), result("5"), call(answer)],
        "two calls in one turn": [
            system, user, call(add, ("calculator", {"expression": "3 + 2"})), result("5"), result("5"), call(answer)
        ],
        "several tool turns": [system, user, call(add), result("5"), call(add), result("5"), call(add), result("5"),
                               call(answer)],
        "a second user query": [system, user, call(add), result("5"), call(answer, content="It is 5.\n"),
                                result("correct"), {"role": "user", "content": "And 5 + 5?"},
                                call(("calculator", {"expression": "5 + 5"})), result("10"),
                                call(("answer", {"answer": "10"}))],
        "a malformed turn": [system, user, {"role": "assistant", "content": 'I add. <tool_call>{"name": calculator}'},
                             result("Error: not JSON"), call(answer)],
    }  # fmt: skip
    if enable_thinking is not False:
        cases["reasoning"] = [system, user, call(add, reasoning="I need the sum."), result("5"),
                              call(answer, reasoning="The tool says 5.")]  # fmt: skip
        cases["an empty think block"] = [system, user, call(add, reasoning=""), result("5"), call(answer, reasoning="")]
        cases["reasoning before a second user query"] = [
            system, user, call(add, reasoning="I need the sum."), result("5"), call(answer, reasoning="It is 5."),
            result("correct"), {"role": "user", "content": "And 5 + 5?"},
            call(("calculator", {"expression": "5 + 5"}), reasoning="Again."), result("10"),
        ]  # fmt: skip
    return {name: (messages, tools) for name, messages in cases.items()}


def resolve_chat_format(
    tokenizer, choice: str = "auto", enable_thinking: bool | None = None, reasoning_parser: bool = False
) -> ChatFormat:
    """The chat format a run trains with (``model.chat_template``), checked by ``probe_problems``:

    - ``tokenizer``: the tokenizer's own template, refused (``ChatTemplateError``) when it fails the probe;
    - ``prefix``: ``PREFIX_QWEN3_TEMPLATE``;
    - a ``.jinja`` file: that template, refused when it fails the probe;
    - ``auto``: the tokenizer's when it passes; else ``PREFIX_QWEN3_TEMPLATE`` when it renders the first
      prompt of every probe case (with and without tools) as the tokenizer's does, so the model reads the
      prompt it was tuned on; else refused.

    The run saves the chosen template with its tokenizer, so the export ships it and a server renders
    with it."""
    if choice == "prefix":
        return ChatFormat(tokenizer, PREFIX_QWEN3_TEMPLATE, enable_thinking, reasoning_parser)
    if choice.endswith(".jinja"):
        try:
            with open(choice) as f:
                template = f.read()
        except OSError as e:
            raise ChatTemplateError(f"model.chat_template: cannot read {choice}: {e.strerror}") from None
        chat = ChatFormat(tokenizer, template, enable_thinking, reasoning_parser)
        chat.check(f"model.chat_template {choice}")
        return chat
    own = ChatFormat(tokenizer, None, enable_thinking, reasoning_parser)
    problems = probe_problems(own)
    if not problems:
        return own
    if choice == "tokenizer":
        own.check()
    prefix = ChatFormat(tokenizer, PREFIX_QWEN3_TEMPLATE, enable_thinking, reasoning_parser)
    for name, (messages, tools) in _probe_cases(enable_thinking).items():
        for offered in (tools, None):
            ours, theirs = prefix.render(messages[:2], offered, True), own.render(messages[:2], offered, True)
            if ours != theirs:
                raise ChatTemplateError(
                    f"model.tokenizer's chat template cannot keep what is trained equal to what a server renders "
                    f"({problems[0]}), and nemo-orchestra's prefix-preserving Qwen3 template renders its first "
                    f"prompt differently ({first_difference(ours, theirs)}): give a template file that passes "
                    "(model.chat_template=FILE.jinja)"
                )
    log.warning(
        "model.chat_template=auto: the tokenizer's chat template cannot keep what is trained equal to what a "
        "server renders (%s); training with nemo-orchestra's prefix-preserving Qwen3 template, which renders "
        "the same first prompt and which the export ships (model.chat_template=tokenizer refuses instead)",
        problems[0][:300],
    )
    return prefix
