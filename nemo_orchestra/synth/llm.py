"""LLM-driven synthesis: reword candidates with a model, then keep those it solves 1..k-1 times in k tries.

1. Paraphrase (``llm.paraphrase``): the model rewords each QA problem, or the customer's
   request of a domain task. Answers never come from the model: a rewording is accepted only if
   every protected token of the original (numbers, ids, dates, capitalized names, quoted
   titles) survives it; otherwise the original wording is kept (counted in the stats).
2. pass@k (the paper's filter): the model acts as the policy through a local tool service on
   each candidate, with the needed tools only (no ``expert``: the teacher must solve it
   itself), ``k`` times with seeds 0..k-1. Outcomes come from the service's verifiers (answer
   checks, database state). Candidates solved between 1 and k-1 times are kept: never solved
   is likely broken or too hard, always solved teaches nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import re
from typing import Any

import aiohttp
from tqdm import tqdm

from nemo_orchestra.synth.candidates import DOMAIN_CATEGORY, Candidate
from nemo_orchestra.synth.records import RecordOptions, make_record

log = logging.getLogger(__name__)

PARAPHRASE_SYSTEM = (
    "You reword tasks. Rewrite the user's text so it reads naturally and differently, keeping its meaning. "
    "Keep every name, number, id, date, amount and quoted title exactly as written. "
    "Reply with the rewritten text only."
)
_PROTECTED = re.compile(
    r"(?<![A-Za-z])'[^']+'(?![A-Za-z])|[A-Z]{1,4}-\d+[A-Z]?|\d[\d.,:/-]*\d|\d|\b[A-Z][a-z]+(?:\s[A-Z][a-z]+)*"
)


def protected_tokens(text: str) -> set[str]:
    """Strings a rewording must keep verbatim (the first word of a sentence is exempt)."""
    tokens = set(_PROTECTED.findall(text))
    starts = {m.group(1) for m in re.finditer(r"(?:^|[.?!]\s+)([A-Z][a-z]+)\b", text)}
    return {t for t in tokens if t not in starts}


def accept_rewording(original: str, rewritten: str) -> bool:
    rewritten = rewritten.strip()
    return (
        bool(rewritten)
        and len(rewritten) < 4 * len(original) + 200
        and all(t in rewritten for t in protected_tokens(original))
    )


async def _chat(session: aiohttp.ClientSession, opts: Any, messages: list[dict[str, str]]) -> str:
    import os

    headers = {"Authorization": f"Bearer {os.environ[opts.api_key_env]}"} if opts.api_key_env else None
    body = {"model": opts.model, "messages": messages, "temperature": opts.temperature, "max_tokens": opts.max_tokens}
    async with session.post(opts.base_url.rstrip("/") + "/chat/completions", json=body, headers=headers) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {text[:200]}")
    return json.loads(text)["choices"][0]["message"]["content"] or ""


def _with_text(c: Candidate, new: str) -> Candidate:
    if c.category == DOMAIN_CATEGORY:
        old = c.meta["scenario"]
        meta = {**c.meta, "scenario": new, "original_scenario": old}
        return dataclasses.replace(c, problem=c.problem.replace(old, new), meta=meta)
    return dataclasses.replace(c, problem=new, meta={**c.meta, "original_problem": c.problem})


async def paraphrase_all(opts: Any, candidates: list[Candidate], progress: bool) -> tuple[list[Candidate], dict]:
    sem = asyncio.Semaphore(opts.concurrency)
    stats = {"paraphrased": 0, "paraphrase_rejected": 0, "paraphrase_failed": 0}
    bar = tqdm(total=len(candidates), desc="paraphrase", disable=not progress)
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)

    async def one(session: aiohttp.ClientSession, c: Candidate) -> Candidate:
        original = c.meta["scenario"] if c.category == DOMAIN_CATEGORY else c.problem
        async with sem:
            try:
                new = await _chat(
                    session,
                    opts,
                    [{"role": "system", "content": PARAPHRASE_SYSTEM}, {"role": "user", "content": original}],
                )
            except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError) as e:
                log.debug("paraphrase failed: %s", e)
                stats["paraphrase_failed"] += 1
                new = None
        bar.update(1)
        if new is None:
            return c
        if not accept_rewording(original, new):
            stats["paraphrase_rejected"] += 1
            return c
        stats["paraphrased"] += 1
        return _with_text(c, new.strip())

    async with aiohttp.ClientSession(timeout=timeout) as session:
        out = await asyncio.gather(*(one(session, c) for c in candidates))
    bar.close()
    return list(out), stats


async def pass_at_k(cfg: Any, candidates: list[Candidate]) -> list[int]:
    """How many of ``k`` attempts by the model solve each candidate, through a local tool service."""
    from nemo_orchestra.evaluation.openai_policy import OpenAIChatPolicy
    from nemo_orchestra.evaluation.harness import PolicyRun, run_all
    from nemo_orchestra.rollout.loop import LoopLimits
    from tools_env.client import ToolsEnvClient
    from tools_env.supervisor import start_service

    opts = cfg.llm
    bare = RecordOptions(distractors_min=0, distractors_max=0, price_jitter=0.0)
    records = []
    for c in candidates:  # the needed tools only: the teacher solves without experts
        r = make_record(c, random.Random(0), bare, [])
        r.tools = [t for t in c.needed_tools if t != "expert"]
        r.preference = {"accuracy": 1.0, "cost": 0.0, "latency": 0.0}
        records.append(r)
    policy = OpenAIChatPolicy(
        opts.base_url,
        opts.model,
        api_key_env=opts.api_key_env,
        temperature=opts.temperature,
        max_tokens=opts.max_tokens,
        timeout_s=opts.timeout_s,
    )
    service = {"tools": {"search": {"corpus_seed": cfg.corpus_seed}}}
    with start_service(service) as svc:
        client = ToolsEnvClient(svc.urls, token=svc.token)
        try:
            run = PolicyRun(policy, LoopLimits(max_turns=opts.max_turns))
            results = await run_all(
                client,
                [run],
                records,
                {"teacher": None},
                samples=opts.k,
                concurrency=opts.concurrency,
                progress=cfg.progress,
            )
        finally:
            await client.aclose()
            await policy.aclose()
    solved: dict[str, int] = {r.id: 0 for r in records}
    for res in results:
        solved[res.task_id] += int(res.correct)
    return [solved[r.id] for r in records]


def filter_with_llm(cfg: Any, candidates: list[Candidate]) -> tuple[list[Candidate], dict]:
    """Paraphrase (optional) and pass@k-filter ``candidates``; returns the kept ones and stats."""
    opts = cfg.llm
    stats: dict[str, Any] = {"mode": "llm", "model": opts.model, "k": opts.k, "candidates": len(candidates)}
    if opts.paraphrase:
        candidates, p_stats = asyncio.run(paraphrase_all(opts, candidates, cfg.progress))
        stats.update(p_stats)
    solved = asyncio.run(pass_at_k(cfg, candidates))
    histogram: dict[str, int] = {}
    kept = []
    for c, s in zip(candidates, solved):
        histogram[str(s)] = histogram.get(str(s), 0) + 1
        if 1 <= s <= opts.k - 1:
            kept.append(dataclasses.replace(c, meta={**c.meta, "pass_at_k": {"k": opts.k, "solved": s}}))
    stats.update({"solved_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))), "kept": len(kept)})
    log.info(
        "pass@%d filter kept %d of %d candidates (solved histogram %s)",
        opts.k,
        len(kept),
        len(candidates),
        stats["solved_histogram"],
    )
    return kept, stats
