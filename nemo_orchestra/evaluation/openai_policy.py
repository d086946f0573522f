"""A chat model behind an OpenAI-compatible endpoint (vLLM, NIM, hosted APIs) as the policy.

Each turn posts the conversation with the episode's tool schemas in ``tools``. The call is
read from the OpenAI ``tool_calls`` field when the server parses tool calls (vLLM with
``--tool-call-parser hermes``), else from ``<tool_call>{"name", "arguments"}</tool_call>`` in
the text (Qwen3's format, any server). The system prompt states the user's preference vector
and asks for exactly one call per turn. The policy's own tokens are priced at
``price_in``/``price_out`` $/1M (default 0.2/0.2, Qwen3-8B as the orchestrator in the paper).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import aiohttp

from nemo_orchestra.evaluation.policy import (
    Policy,
    PolicyFormatError,
    PolicyInput,
    ToolCall,
)
from nemo_orchestra.prompting.chat import ToolCallParseError, parse_tool_call

SYSTEM_PROMPT = (
    "You are an orchestrator: you solve the user's task by calling tools, including stronger models "
    "through the `expert` tool. Read each tool's description: prices and latencies differ per task. "
    "The user's preference weights (higher means it matters more): {preference}. "
    "Call exactly one tool per turn, as <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}</tool_call>. "
    "Finish by calling `answer` with the final answer."
)


def parse_text_tool_call(text: str) -> tuple[str, dict[str, Any]]:
    try:
        call = parse_tool_call(text or "")
    except ToolCallParseError as e:
        raise PolicyFormatError(str(e)) from None
    return call.name, call.arguments


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise PolicyFormatError(f"tool call arguments are not valid JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise PolicyFormatError("tool call arguments must be a JSON object")
    return value


def parse_reply(message: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The first tool call of a chat completion message: the ``tool_calls`` field, else the text."""
    calls = message.get("tool_calls") or []
    if calls:
        fn = calls[0].get("function") or {}
        if not isinstance(fn.get("name"), str):
            raise PolicyFormatError("tool_calls[0] has no function name")
        args = fn.get("arguments", {})
        return fn["name"], _json_object(args) if isinstance(args, str) else args
    return parse_text_tool_call(message.get("content") or "")


class OpenAIChatPolicy(Policy):
    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None, temperature: float = 0.0,
                 max_tokens: int = 1024, timeout_s: float = 120.0, price_in: float = 0.2, price_out: float = 0.2,
                 send_tools: bool = True, seed_per_sample: bool = True) -> None:
        self.name = f"openai:{model}"
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.price_in, self.price_out = price_in, price_out
        self.send_tools, self.seed_per_sample = send_tools, seed_per_sample
        self._session: aiohttp.ClientSession | None = None

    def request(self, inp: PolicyInput) -> dict[str, Any]:
        pref = json.dumps(inp.preference, sort_keys=True) if inp.preference else "none given"
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT.format(preference=pref)}, *inp.messages],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.send_tools:
            body["tools"] = inp.tools
        if self.seed_per_sample:
            body["seed"] = inp.sample
        return body

    async def act(self, inp: PolicyInput) -> ToolCall:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            async with self._session.post(self.url, json=self.request(inp), headers=headers) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise RuntimeError(f"{self.url}: HTTP {resp.status}: {text[:300]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise RuntimeError(f"{self.url}: {type(e).__name__}: {e}") from None
        data = json.loads(text)
        message = data["choices"][0]["message"]
        usage = {k: int(v) for k, v in (data.get("usage") or {}).items() if k in ("prompt_tokens", "completion_tokens")}
        cost = (usage.get("prompt_tokens", 0) * self.price_in + usage.get("completion_tokens", 0) * self.price_out) / 1e6
        try:
            name, arguments = parse_reply(message)
        except PolicyFormatError as e:
            e.usage, e.cost, e.text = usage, cost, message.get("content") or ""
            raise
        return ToolCall(name, arguments, text=message.get("content") or "", usage=usage, cost=cost)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
