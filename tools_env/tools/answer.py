"""`answer`: submit the final answer. Ends the episode; the outcome comes from ``tools_env.verify``.

The ``ToolResult`` carries ``done=True`` and ``meta["outcome"]`` (an ``Outcome``); the
episode store turns that into the step response's ``outcome``. The final answer is also left in
``ctx.state["final_answer"]`` for verifiers (db_state) that grade what was communicated.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import aiohttp

from tools_env.config import JudgeConfig
from tools_env.tools.base import EpisodeContext, Tool, ToolResult, register_tool
from tools_env.tools.experts import EndpointError, chat_completion
from tools_env.verify import verify

JUDGE_PROMPT = """You grade answers. Decide whether the predicted answer means the same as the gold answer \
for the question. Reply with exactly one word, CORRECT or INCORRECT.

Question: {problem}
Gold answer: {gold}
Predicted answer: {pred}"""


class LLMJudge:
    """An OpenAI-compatible endpoint asked ``CORRECT``/``INCORRECT`` about one answer."""

    def __init__(self, cfg: JudgeConfig) -> None:
        self.cfg = cfg
        self._session: aiohttp.ClientSession | None = None

    async def grade(self, problem: str, gold: str, pred: str) -> tuple[bool, str]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        prompt = JUDGE_PROMPT.format(problem=problem, gold=gold, pred=pred)
        try:
            content, _ = await chat_completion(
                self._session, self.cfg.base_url, self.cfg.model, [{"role": "user", "content": prompt}],
                api_key=os.environ.get(self.cfg.api_key_env) if self.cfg.api_key_env else None,
                timeout_s=self.cfg.timeout_s, max_retries=self.cfg.max_retries, backoff_s=self.cfg.backoff_s,
                params={"temperature": 0.0, "max_tokens": 8})
        except EndpointError as e:
            return False, f"judge endpoint failed: {e}"
        words = re.findall(r"[A-Za-z]+", content.upper())
        if words and words[0] in ("CORRECT", "INCORRECT"):
            return words[0] == "CORRECT", f"{self.cfg.model} says {words[0]}"
        return False, f"unparseable judge reply {content[:80]!r}"

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@register_tool
class Answer(Tool):
    name = "answer"
    description = "Submit your final answer. This ends the task; call it once, when you are sure."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "the final answer, as short as possible"}},
        "required": ["answer"],
    }

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        judge = self.config.get("judge")
        if judge is not None and not isinstance(judge, JudgeConfig):
            judge = JudgeConfig.from_dict(judge)
        self.judge = LLMJudge(judge) if judge is not None else None

    async def call(self, arguments: dict[str, Any], ctx: EpisodeContext) -> ToolResult:
        t0 = time.perf_counter()
        answer = arguments["answer"]
        ctx.state["final_answer"] = answer
        outcome = await verify(answer, ctx.task, ctx, self.judge)
        return ToolResult(observation="Answer submitted.", latency_s=time.perf_counter() - t0, done=True,
                          meta={"outcome": outcome})

    async def aclose(self) -> None:
        if self.judge is not None:
            await self.judge.aclose()
