"""Where a malformed turn leaves every well-formed one.

A well-formed turn is a plan (free text, or a think block) followed by one or more
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks and nothing else, where the name is a
tool the episode offers and the arguments fit its JSON schema: known keys, string values for string
properties, enum values from their enum. ``first_break`` reads a turn's text left to right and returns
the offset of the first character that no such turn continues, the one the policy chose wrong; the
characters before it are a prefix of some well-formed turn (``advantage.train_malformed_calls`` trains
that token alone). It is a prefix check, not a full validator: a call that parses but breaks a rule no
prefix shows (a missing required key, ``answer``'s either/or) has no break.
"""

from __future__ import annotations

from typing import Any

from nemo_orchestra.prompting.chat import SPECIAL_TOKENS, ChatFormat

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_ESCAPES = set('"\\/bfnrtu')
_HEX = set("0123456789abcdefABCDEF")
_WS = " \t\n\r"
_NOT_IN_PLAN = [t for t in SPECIAL_TOKENS if t not in ("<think>", "</think>", CALL_OPEN)]


class _Break(Exception):
    def __init__(self, pos: int):
        self.pos = pos


class _End(Exception):
    """The text ran out in the middle of a well-formed turn."""


def first_break(text: str, tools: list[dict[str, Any]] | None) -> int | None:
    """The offset in ``text`` (a turn, without its end-of-turn token) of the first character no
    well-formed turn has there: ``len(text)`` when ``text`` stops inside one (a proper prefix), None when
    it is one."""
    try:
        _Reader(text, tools or []).turn()
    except _Break as b:
        return b.pos
    except _End:
        return len(text)
    return None


def break_index(chat: ChatFormat, ids: list[int], tools) -> int | None:
    """The index in a turn's ``ids`` of the token that first leaves every well-formed turn offering
    ``tools``: the one whose text holds the first wrong character (``first_break``), or the end-of-turn token
    when the turn ended inside a call. None when no token does: a well-formed turn, a turn cut at the token
    limit inside a call, or a call whose fault no prefix shows."""
    finished = bool(ids) and ids[-1] == chat.end_of_turn_id
    body = list(ids[:-1]) if finished else list(ids)
    text = chat.decode(body)
    pos = first_break(text, tools)
    if pos is None:
        return None
    if pos >= len(text):
        return len(body) if finished else None
    lo, hi = 1, len(body)  # the fewest ids whose text reaches past pos
    while lo < hi:
        mid = (lo + hi) // 2
        if len(chat.decode(body[:mid])) > pos:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


class _Reader:
    def __init__(self, text: str, tools: list[dict[str, Any]]):
        self.s, self.i = text, 0
        self.tools = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools if "function" in t}

    # -- characters
    def peek(self) -> str:
        if self.i >= len(self.s):
            raise _End
        return self.s[self.i]

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in _WS:
            self.i += 1

    def literal(self, word: str) -> None:
        for ch in word:
            if self.peek() != ch:
                raise _Break(self.i)
            self.i += 1

    # -- the turn
    def turn(self) -> None:
        first = self.s.find(CALL_OPEN)
        plan_end = len(self.s) if first < 0 else first
        for pos in range(plan_end):  # the plan is free text and think tags; no other special token
            if self.s[pos] == "<" and any(self.s.startswith(t, pos) for t in _NOT_IN_PLAN):
                raise _Break(pos)
        if first < 0:  # no call yet: the plan, then (after its think block, if any) the call's opening
            close = self.s.find("</think>")
            if close < 0:
                raise _End
            self.i = close + len("</think>")
            self.ws()
            self.literal(CALL_OPEN)
            raise _End
        self.i = first
        while True:
            self.literal(CALL_OPEN)
            self.ws()
            self.call()
            self.ws()
            self.literal(CALL_CLOSE)
            self.ws()
            if self.i >= len(self.s):
                return

    def call(self) -> None:
        name: list[str | None] = [None]

        def member(key: str) -> None:
            if key == "name":
                name[0] = self.string(choices=list(self.tools) or None)
            else:
                self.value(self.tools.get(name[0], {}) if name[0] is not None else {}, arguments=True)

        self.object(["name", "arguments"], member)

    # -- JSON values, checked against a schema where one applies
    def value(self, schema: dict[str, Any], arguments: bool = False) -> None:
        ch = self.peek()
        kind = schema.get("type")
        if arguments or kind == "object":
            props = schema.get("properties")
            if ch != "{":
                if arguments and ch == '"':  # arguments as a JSON string (some servers and models)
                    self.string()
                    return
                raise _Break(self.i)
            if props is None:
                self.object(None, lambda key: self.value({}))
            else:
                self.object(list(props), lambda key: self.value(props.get(key, {})))
            return
        if kind == "string" and ch != '"':
            raise _Break(self.i)
        if ch == '"':
            if kind not in (None, "string"):
                raise _Break(self.i)
            self.string(choices=schema.get("enum"))
        elif ch == "{":
            self.object(None, lambda key: self.value({}))
        elif ch == "[":
            self.array()
        elif ch in "-0123456789":
            self.number()
        elif ch in "tfn":
            self.literal({"t": "true", "f": "false", "n": "null"}[ch])
        else:
            raise _Break(self.i)

    def object(self, keys: list[str] | None, member) -> None:
        def item() -> None:
            key = self.string(choices=keys)
            self.ws()
            self.literal(":")
            self.ws()
            member(key)

        self.items("{", "}", item)

    def array(self) -> None:
        self.items("[", "]", lambda: self.value({}))

    def items(self, open_: str, close: str, item) -> None:
        """``open_``, then ``item``s separated by commas, then ``close`` (a JSON object's or array's)."""
        self.literal(open_)
        self.ws()
        if self.peek() == close:
            self.i += 1
            return
        while True:
            item()
            self.ws()
            ch = self.peek()
            if ch == close:
                self.i += 1
                return
            if ch != ",":
                raise _Break(self.i)
            self.i += 1
            self.ws()

    def number(self) -> None:
        start = self.i
        if self.peek() == "-":
            self.i += 1
        digits = 0
        while self.i < len(self.s) and (self.s[self.i].isdigit() or self.s[self.i] in ".eE+-"):
            digits += self.s[self.i].isdigit()
            self.i += 1
        if not digits and self.i < len(self.s):
            raise _Break(start + 1)

    def string(self, choices: list[str] | None = None) -> str:
        """A JSON string; with ``choices``, one of them (a break at the first character that leaves them all).
        A special token inside a string breaks it: a server's parsers cut the turn there."""
        self.literal('"')
        out: list[str] = []
        while True:
            ch = self.peek()
            if ch == '"':
                if choices is not None and "".join(out) not in choices:
                    raise _Break(self.i)
                self.i += 1
                return "".join(out)
            if ch == "<" and any(self.s.startswith(tok, self.i) for tok in SPECIAL_TOKENS):
                raise _Break(self.i)
            if ch == "\\":
                self.i += 1
                esc = self.peek()
                if esc not in _ESCAPES:
                    raise _Break(self.i)
                self.i += 1
                if esc == "u":
                    for _ in range(4):
                        if self.peek() not in _HEX:
                            raise _Break(self.i)
                        self.i += 1
                ch = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "u": "?"}.get(esc, esc)
            elif ch < " ":
                raise _Break(self.i)
            else:
                self.i += 1
            out.append(ch)
            if choices is not None and not any(c.startswith("".join(out)) for c in choices):
                raise _Break(self.i - 1)
