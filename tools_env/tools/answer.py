"""`answer`: submit the final answer. Ends the episode; the outcome comes from ``tools_env.verify``.

Arguments: ``{"answer": str}``, the policy's own answer, or ``{"model": alias}``, an expert that
writes the final answer from the task and the episode's tool results, billed at its price — the
``answer`` tool of ToolOrchestra, whose ``model`` argument names an answering model
(``answer-1..4`` there).

The ``ToolResult`` carries ``done=True`` and ``meta["outcome"]`` (an ``Outcome``); the
episode store turns that into the step response's ``outcome``. The final answer is also left in
``ctx.state["final_answer"]`` for verifiers (db_state) that grade what was communicated. In a
multi-turn task (a verifier type with a turn hook, ``tools_env.verify.next_user_turn``) an
answer before the last user turn ends that turn only: its observation is the next user turn.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import aiohttp

from tools_env.service_config import JudgeConfig
from tools_env.tools.base import EpisodeContext, Tool, ToolArgumentError, ToolResult, register_tool
from tools_env.tools.experts import EndpointError, Expert, chat_completion
from tools_env.verify import next_user_turn, verify

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
                self._session,
                self.cfg.base_url,
                self.cfg.model,
                [{"role": "user", "content": prompt}],
                api_key=os.environ.get(self.cfg.api_key_env) if self.cfg.api_key_env else None,
                timeout_s=self.cfg.timeout_s,
                max_retries=self.cfg.max_retries,
                backoff_s=self.cfg.backoff_s,
                params={"temperature": 0.0, "max_tokens": 8},
            )
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
    description = (
        "Submit the final answer: give 'answer' (your own), or 'model' (an expert alias from the "
        "expert table, billed at its price) to have that expert write it from the task and the tool "
        "results so far. This ends the task; call it once, when you are sure."
    )

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        judge = self.config.get("judge")
        if judge is not None and not isinstance(judge, JudgeConfig):
            judge = JudgeConfig.from_dict(judge)
        self.judge = LLMJudge(judge) if judge is not None else None
        self.writer = (
            Expert({"experts": self.config["experts"], "seed": self.config.get("seed", 0)})
            if self.config.get("experts") is not None
            else None
        )
        aliases = self.writer.experts.aliases if self.writer is not None else []
        self.parameters = {
            "type": "object",
            "properties": {
                "answer": {"type": "string", "description": "your final answer, as short as possible"},
                "model": {"type": "string", "enum": aliases, "description": "or: the expert that writes it"},
            },
            "required": [],
        }

    def check_arguments(self, arguments: Any) -> dict[str, Any]:
        args = super().check_arguments(arguments)
        if ("answer" in args) == ("model" in args):
            raise ToolArgumentError(
                "answer: give either 'answer' (your final answer) or 'model' (an expert alias that writes it)"
            )
        return args

    async def call(self, arguments: dict[str, Any], ctx: EpisodeContext) -> ToolResult:
        t0 = time.perf_counter()
        written = None
        if "model" in arguments:
            assert self.writer is not None  # no aliases without experts, so check_arguments refused it
            answer, written = await self.writer.write_answer(arguments["model"], ctx)
            if answer is None:  # the expert failed: the episode goes on, the policy may answer otherwise
                return written
        else:
            answer = arguments["answer"]
        ctx.state["final_answer"] = answer
        follow_up = next_user_turn(answer, ctx.task, ctx)
        if follow_up is not None:  # a multi-turn task: the user's next turn, the episode goes on
            return ToolResult(
                observation=follow_up,
                cost=0.0 if written is None else written.cost,
                latency_s=time.perf_counter() - t0,
                meta={"turn_ended": True},
            )
        outcome = await verify(answer, ctx.task, ctx, self.judge)
        meta: dict[str, Any] = {"outcome": outcome}
        if written is None:
            return ToolResult(observation="Answer submitted.", latency_s=time.perf_counter() - t0, done=True, meta=meta)
        meta.update(model=arguments["model"], answer=answer)
        return ToolResult(
            observation=f"Answer submitted ({arguments['model']} wrote: {answer}).",
            cost=written.cost,
            latency_s=written.latency_s,
            usage=written.usage,
            done=True,
            meta=meta,
        )

    async def aclose(self) -> None:
        if self.judge is not None:
            await self.judge.aclose()
        if self.writer is not None:
            await self.writer.aclose()
