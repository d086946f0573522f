"""`expert`: ask a stronger model, by alias — a real OpenAI-compatible endpoint or a simulated one.

Arguments ``{"model": alias, "query": str}``. The description shown to the policy embeds a
price and latency table per alias; a task's ``prices`` override the configured prices for its
episode (and the table shows the episode's prices).

- Endpoint experts (vLLM, NIM, hosted APIs): ``POST {base_url}/chat/completions``; cost from the
  reported ``usage`` at the alias' $/1M prices; latency is wall-clock, retries included. Retries
  on connection errors, 408/429/5xx with exponential backoff inside the alias' deadline
  (``timeout_s``); a hanging or dead endpoint ends as an error observation at the deadline.
- Simulated experts (offline runs): with probability ``accuracy[category]`` the observation is
  ``"<alias>: The answer is <gold>."``, otherwise a plausible wrong answer. The draw is seeded by
  (service seed, task id, turn, ``task.meta["seed"]`` if any), so runs are reproducible. Usage:
  ``len(query) / 4 + prompt_overhead_tokens`` in, ``output_tokens[category]`` out. The latency is
  reported, not slept, unless ``experts.sleep`` is true (then it waits ``latency * sleep_scale``).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from typing import Any

import aiohttp

from tools_env.service_config import EndpointExpertConfig, ExpertsConfig, SimulatedExpertConfig, for_category
from tools_env.tools.base import EpisodeContext, Tool, ToolResult, register_tool
from tools_env.verify import normalize_answer, parse_number

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class EndpointError(RuntimeError):
    pass


def _parse_completion(text: str) -> tuple[str, dict[str, int]]:
    import json

    try:
        data = json.loads(text)
        content = data["choices"][0]["message"]["content"] or ""
    except (ValueError, KeyError, IndexError, TypeError):
        raise EndpointError(f"malformed chat completion: {text[:200]!r}") from None
    usage = data.get("usage") or {}
    tokens = {k: int(usage[k]) for k in ("prompt_tokens", "completion_tokens") if isinstance(usage.get(k), int)}
    return str(content), tokens


async def chat_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    messages: list[dict[str, str]],
    *,
    api_key: str | None = None,
    timeout_s: float = 60.0,
    max_retries: int = 3,
    backoff_s: float = 0.5,
    params: dict[str, Any] | None = None,
) -> tuple[str, dict[str, int]]:
    """One chat completion with retries inside a deadline; ``(content, usage)`` or EndpointError."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout_s
    url = base_url.rstrip("/") + "/chat/completions"
    payload = {"model": model, "messages": messages, **(params or {})}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    last, attempt = "no attempt made", 0
    for attempt in range(max_retries + 1):
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        try:
            async with session.post(
                url, json=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=remaining)
            ) as resp:
                text = await resp.text(errors="replace")
                if resp.status == 200:
                    return _parse_completion(text)
                last = f"HTTP {resp.status}: {text[:200]}"
                if resp.status not in RETRYABLE_STATUS:
                    raise EndpointError(last)
        except asyncio.TimeoutError:
            last = f"no response within the {timeout_s:g}s deadline"
        except (aiohttp.ClientError, OSError) as e:
            last = f"{type(e).__name__}: {e}"
        delay = backoff_s * 2**attempt
        if attempt == max_retries or loop.time() + delay >= deadline:
            break
        await asyncio.sleep(delay)
    raise EndpointError(f"gave up after {attempt + 1} attempt(s) in {loop.time() - start:.2f}s: {last}")


_DISTRACTORS = (
    "Paris",
    "London",
    "1987",
    "George Washington",
    "oxygen",
    "Jupiter",
    "blue",
    "Shakespeare",
    "Tokyo",
    "the Pacific Ocean",
    "carbon",
    "Einstein",
)


def wrong_answer(gold: str, rng: random.Random) -> str:
    """A plausible answer that is not ``gold``: a perturbed number; for a one-word name, a
    near miss made of the same letters (so a wrong answer is as unpredictable as the right one
    and a policy cannot learn to prefer stock strings); else another string."""
    x = parse_number(gold)
    if x is not None:
        if x.is_integer() and abs(x) < 1e15:
            step = rng.randint(1, max(1, int(abs(x) * 0.2)))
            return str(int(x) + rng.choice((-1, 1)) * step)
        if x == 0:
            return "1"
        decimals = len(gold.strip().rstrip("0").split(".")[-1]) if "." in gold else 3
        value = round(x * rng.choice((rng.uniform(0.5, 0.9), rng.uniform(1.1, 1.5))), max(decimals, 1))
        return repr(value) if value != x else repr(x + 1)
    g = normalize_answer(gold)
    if g in ("yes", "no"):
        return "no" if g == "yes" else "yes"
    word = gold.strip()
    if word.isalpha() and len(set(word.lower())) >= 2:
        for k in rng.sample(range(1, len(word)), len(word) - 1):
            near = (word[k:] + word[:k]).lower()
            near = near.capitalize() if word[0].isupper() else near
            if normalize_answer(near) != g:
                return near
    choices = [d for d in _DISTRACTORS if normalize_answer(d) != g]
    return rng.choice(choices)


def _states(observation: str, gold: str) -> bool:
    """Whether a tool result states ``gold`` (normalized) as a whole word or number."""
    return re.search(rf"(?<![\w.]){re.escape(gold)}(?![\w]|\.\d)", normalize_answer(observation)) is not None


def writer_from(config: dict[str, Any]) -> "Expert | None":
    """The expert that writes for a tool (``answer``'s answer, ``search``'s query) from the tool's config
    (``experts`` and ``seed``, as the service passes them); None without experts."""
    if config.get("experts") is None:
        return None
    return Expert({"experts": config["experts"], "seed": config.get("seed", 0)})


def context_query(ctx: EpisodeContext, instruction: str) -> str:
    """What an expert that writes from the context is sent: the task, each tool result so far, then
    ``instruction``."""
    transcript = ctx.state.get("transcript", [])
    return "\n\n".join(
        [f"Task: {ctx.task.problem}", *(f"{name} returned: {obs}" for name, obs in transcript), instruction]
    )


@register_tool
class Expert(Tool):
    name = "expert"
    description = "Ask a stronger model a question and get its answer."

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        experts = self.config.get("experts")
        if experts is None:
            experts = ExpertsConfig()
        elif not isinstance(experts, ExpertsConfig):
            experts = ExpertsConfig.from_dict(experts)
        self.experts: ExpertsConfig = experts
        self.seed = int(self.config.get("seed", 0))
        aliases = experts.aliases
        self.parameters = {
            "type": "object",
            "properties": {
                "model": {"type": "string", "enum": aliases, "description": "expert alias from the table"},
                "query": {"type": "string", "description": "the question, self-contained"},
            },
            "required": ["model", "query"],
        }
        self._session: aiohttp.ClientSession | None = None
        self._schema_cache: dict[str, dict[str, Any]] = {}

    def _prices(self, alias: str, ctx: EpisodeContext | None) -> tuple[float, float]:
        cfg = self.experts.endpoints.get(alias) or self.experts.simulated[alias]
        override = ctx.task.prices.get(alias, {}) if ctx is not None else {}
        return float(override.get("input", cfg.price_in)), float(override.get("output", cfg.price_out))

    def _latency_hint(self, alias: str, category: str) -> str:
        if alias in self.experts.simulated:
            lo, hi = for_category(self.experts.simulated[alias].latency_s, category)
            return f"{(lo + hi) / 2:.1f}"
        hint = self.experts.endpoints[alias].latency_hint_s
        return "?" if hint is None else f"{hint:.1f}"

    def schema(self, ctx: EpisodeContext | None = None) -> dict[str, Any]:
        category = ctx.task.category if ctx is not None else "default"
        cacheable = ctx is None or not ctx.task.prices
        if cacheable and category in self._schema_cache:
            return self._schema_cache[category]
        rows = [
            "| model | $ per 1M input tokens | $ per 1M output tokens | typical latency (s) |",
            "| --- | --- | --- | --- |",
        ]
        for alias in self.experts.aliases:
            p_in, p_out = self._prices(alias, ctx)
            label = f"{alias} (simulated)" if alias in self.experts.simulated else alias
            rows.append(f"| {label} | {p_in:g} | {p_out:g} | {self._latency_hint(alias, category)} |")
        description = (
            "Ask a stronger model a question and get its answer. Models differ in price, "
            "latency and skill:\n" + "\n".join(rows)
        )
        schema = {
            "type": "function",
            "function": {"name": self.name, "description": description, "parameters": self.parameters},
        }
        if cacheable:
            self._schema_cache[category] = schema
        return schema

    async def call(self, arguments: dict[str, Any], ctx: EpisodeContext) -> ToolResult:
        alias = arguments["model"]
        if alias in self.experts.simulated:
            return await self._simulate(alias, self.experts.simulated[alias], arguments["query"], ctx)
        return await self._call_endpoint(alias, self.experts.endpoints[alias], arguments["query"], ctx)

    async def _simulate(
        self, alias: str, sim: SimulatedExpertConfig, query: str, ctx: EpisodeContext, evidence: float = 0.0
    ) -> ToolResult:
        """One simulated answer: right with the alias' accuracy for the category, or ``evidence`` where
        that is higher (the writer's odds with the answer's evidence in front of it)."""
        task, category = ctx.task, ctx.task.category
        rng = random.Random(f"{self.seed}|{task.id}|{ctx.turn}|{task.meta.get('seed', '')}")
        correct = rng.random() < max(for_category(sim.accuracy, category), evidence)
        answer = task.answer if correct else wrong_answer(task.answer, rng)
        lo, hi = for_category(sim.latency_s, category)
        latency = lo if lo == hi else rng.uniform(lo, hi)
        usage = {
            "prompt_tokens": len(query) // 4 + sim.prompt_overhead_tokens,
            "completion_tokens": for_category(sim.output_tokens, category),
        }
        p_in, p_out = self._prices(alias, ctx)
        cost = (usage["prompt_tokens"] * p_in + usage["completion_tokens"] * p_out) / 1e6
        if self.experts.sleep:
            await asyncio.sleep(latency * self.experts.sleep_scale)
        return ToolResult(
            observation=f"{alias}: The answer is {answer}.",
            cost=cost,
            latency_s=latency,
            usage=usage,
            meta={"model": alias, "simulated": True, "correct": correct, "answer": answer, "stated": answer},
        )

    async def write_answer(self, alias: str, ctx: EpisodeContext) -> tuple[str | None, ToolResult]:
        """The final answer written by expert ``alias`` from the task and the episode's tool results
        (ToolOrchestra's ``answer`` with a model argument); ``None`` when the expert failed.

        A simulated writer answers at its accuracy for the category; it copies the gold answer where an
        earlier tool result states it (always right), and where the search results hold every string of
        the task's ``meta["evidence"]`` (the facts the answer follows from, such as the documents a
        multi-step question's years are in) it answers at its ``evidence_accuracy`` for the category. Both
        are read only from the part of a result no text the policy wrote can reach (``ToolResult.meta["stated"]``,
        kept in ``ctx.state["stated"]``: a simulated expert's answer, the calculator's value, the documents a
        search found): code printing every number up to 5000 states any gold number without knowing it, an
        endpoint expert repeats what the policy asked it to, and a printed id is not a retrieved document.
        An endpoint writer gets the problem and the transcript and is asked for the answer alone."""
        stated = ctx.state.get("stated", [])
        query = context_query(ctx, "Reply with the final answer only.")
        if alias in self.experts.simulated:
            sim = self.experts.simulated[alias]
            gold = normalize_answer(ctx.task.answer)
            facts = [str(f) for f in ctx.task.meta.get("evidence") or []]
            evidence = 0.0
            if bool(gold) and any(_states(text, gold) for _, text in stated):
                evidence = 1.0
            elif facts and all(any(f in text for name, text in stated if name == "search") for f in facts):
                evidence = for_category(sim.evidence_accuracy, ctx.task.category)
            result = await self._simulate(alias, sim, query, ctx, evidence)
            return result.meta["answer"], result
        result = await self._call_endpoint(alias, self.experts.endpoints[alias], query, ctx)
        if result.error is not None:
            return None, result
        return result.observation.split(": ", 1)[-1].strip(), result

    async def write_query(self, alias: str, ctx: EpisodeContext) -> tuple[str | None, ToolResult]:
        """A search query written by expert ``alias`` from the task and the episode's tool results
        (ToolOrchestra's ``search`` with a model argument); ``None`` when the expert failed.

        A simulated writer writes the first of the task's ``meta["search_queries"]`` the episode has not
        searched yet (``ctx.state["searches"]``), the last one when all were, or the task's problem when
        the record names none: naming a fact the question states is within every alias' skill. It is billed
        for the context in and the query's tokens out, and takes the alias' latency for the category in
        proportion to the tokens it writes. An endpoint writer gets the task and the transcript and is
        asked for keywords alone; its reply's first line is the query."""
        context = context_query(ctx, "Write a search query (keywords only) for the next fact the task needs.")
        if alias in self.experts.simulated:
            sim = self.experts.simulated[alias]
            wanted = [str(q) for q in ctx.task.meta.get("search_queries") or []]
            done = {q.strip().lower() for q in ctx.state.get("searches", [])}
            todo = [q for q in wanted if q.strip().lower() not in done]
            query = todo[0] if todo else (wanted[-1] if wanted else ctx.task.problem)
            out = max(1, len(query) // 4)
            usage = {"prompt_tokens": len(context) // 4 + sim.prompt_overhead_tokens, "completion_tokens": out}
            p_in, p_out = self._prices(alias, ctx)
            lo, hi = for_category(sim.latency_s, ctx.task.category)
            latency = (lo + hi) / 2 * min(1.0, out / max(1, for_category(sim.output_tokens, ctx.task.category)))
            if self.experts.sleep:
                await asyncio.sleep(latency * self.experts.sleep_scale)
            cost = (usage["prompt_tokens"] * p_in + usage["completion_tokens"] * p_out) / 1e6
            result = ToolResult(observation=query, cost=cost, latency_s=latency, usage=usage, meta={"model": alias})
            return query, result
        result = await self._call_endpoint(alias, self.experts.endpoints[alias], context, ctx)
        if result.error is not None:
            return None, result
        lines = result.observation.split(": ", 1)[-1].strip().splitlines()
        query = lines[0].strip() if lines else ""
        if not query:
            err = f"expert {alias} wrote an empty search query"
            return None, ToolResult(observation=f"{alias}: error: {err}", latency_s=result.latency_s, error=err)
        return query, result

    async def _call_endpoint(self, alias: str, ep: EndpointExpertConfig, query: str, ctx: EpisodeContext) -> ToolResult:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512))
        messages = [{"role": "user", "content": query}]
        if ep.system_prompt:
            messages.insert(0, {"role": "system", "content": ep.system_prompt})
        params = {k: v for k, v in (("max_tokens", ep.max_tokens), ("temperature", ep.temperature)) if v is not None}
        t0 = time.perf_counter()
        try:
            content, usage = await chat_completion(
                self._session,
                ep.base_url,
                ep.model,
                messages,
                api_key=os.environ.get(ep.api_key_env) if ep.api_key_env else None,
                timeout_s=ep.timeout_s,
                max_retries=ep.max_retries,
                backoff_s=ep.backoff_s,
                params=params,
            )
        except EndpointError as e:
            return ToolResult(
                observation=f"{alias}: error: {e}",
                latency_s=time.perf_counter() - t0,
                error=f"expert {alias}: {e}",
                meta={"model": alias},
            )
        latency = time.perf_counter() - t0
        meta: dict[str, Any] = {"model": alias}
        if len(usage) < 2:  # endpoint did not report usage: estimate it at ~4 characters per token
            usage = {
                "prompt_tokens": sum(len(m["content"]) for m in messages) // 4,
                "completion_tokens": len(content) // 4,
            }
            meta["usage_estimated"] = True
        p_in, p_out = self._prices(alias, ctx)
        cost = (usage["prompt_tokens"] * p_in + usage["completion_tokens"] * p_out) / 1e6
        limit = self.experts.max_observation_chars
        if len(content) > limit:
            content = content[:limit] + f"\n[... truncated {len(content) - limit} characters]"
        return ToolResult(observation=f"{alias}: {content}", cost=cost, latency_s=latency, usage=usage, meta=meta)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
