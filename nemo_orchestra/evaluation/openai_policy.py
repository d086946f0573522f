"""A chat model behind an OpenAI-compatible endpoint (vLLM, NIM, hosted APIs) as the policy.

Each turn posts the episode's messages — the prompt training uses (``prompting.prompts``), then
the conversation so far — with the episode's tool schemas in ``tools``, and ``enable_thinking`` as
the template variable (``chat_template_kwargs``) when the run set it. The reply's message is kept
as the server returned it — content, reasoning (``reasoning``/``reasoning_content``) and every tool
call (with the loop's own ids) — so the conversation the next turn continues is the one the model wrote; an
exported orchestrator served by vLLM's OpenAI server then renders it to the token ids training kept
(``prompting.chat``). Calls are read from ``tool_calls`` when the server parses them (vLLM with
``--tool-call-parser hermes``), else from ``<tool_call>{"name", "arguments"}</tool_call>`` in the
text; a reply with neither is a format error the agent loop answers as it does in training. The
policy's own tokens are the server's ``usage``, priced by the loop. An endpoint that cannot be
reached or answers an error ends that episode (``StopReason.POLICY_ERROR``), not the evaluation; a
request a server disconnects before answering (a kept-alive connection it closed while idle) is sent
once more, on a fresh connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import aiohttp

from nemo_orchestra.prompting.chat import request_messages
from nemo_orchestra.rollout.loop import Episode, Turn, turn_seed


log = logging.getLogger(__name__)


class OpenAIChatPolicy:
    """A message-level policy of the agent loop (``rollout.loop.TurnPolicy``)."""

    chat = None  # works on messages

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 1024,
        timeout_s: float = 120.0,
        send_tools: bool = True,
        send_seed: bool = True,
        enable_thinking: bool | None = None,
    ) -> None:
        self.name = f"openai:{model}"
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.send_tools, self.send_seed = send_tools, send_seed
        self.enable_thinking = enable_thinking
        self._session: aiohttp.ClientSession | None = None

    def request(self, ep: Episode) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": request_messages(ep.messages),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.send_tools:
            body["tools"] = ep.tools
        if self.send_seed:  # the turn's own seed, as the engine policy's (vLLM's server honours it)
            body["seed"] = turn_seed(ep)
        if self.enable_thinking is not None:  # the template variable, as the run rendered with it
            body["chat_template_kwargs"] = {"enable_thinking": self.enable_thinking}
        return body

    async def act(self, episodes: list[Episode]) -> list[Turn]:
        return list(await asyncio.gather(*(self.turn(ep) for ep in episodes)))

    async def turn(self, ep: Episode) -> Turn:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            for attempt in range(2):
                try:
                    async with self._session.post(self.url, json=self.request(ep), headers=headers) as resp:
                        body = await resp.text()
                    break
                except aiohttp.ServerDisconnectedError:
                    # closed without an answer, most often a pooled connection the server closed while idle
                    # (uvicorn, vLLM's server: after 5 s); a chat request is safe to send again, once
                    if attempt:
                        raise
            if resp.status != 200:
                return self._failed(ep, f"{self.url}: HTTP {resp.status}: {body[:300]}")
            data = json.loads(body)
            message = data["choices"][0]["message"]
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, KeyError, IndexError) as e:
            return self._failed(ep, f"{self.url}: {type(e).__name__}: {e}")
        usage = data.get("usage") or {}
        if not isinstance(message, dict):
            return self._failed(ep, f"{self.url}: the reply's message is not an object")
        return Turn(
            message.get("content") or "",
            message={**message, "role": "assistant"},
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
        )

    def _failed(self, ep: Episode, why: str) -> Turn:
        log.warning("policy %s failed on task %s: %s", self.name, ep.task.id, why)
        return Turn("", failure=f"policy failed: {why}")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
