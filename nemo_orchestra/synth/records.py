"""From a candidate to a task record: a randomized tool subset, prices and preference vector.

Randomizing what each record offers (which tools, at what price, under which preference) is
what makes a policy read the tool descriptions instead of memorizing names (ToolOrchestra).

- tools: the candidate's needed tools, ``expert`` (always for QA, half the time for domain
  tasks), plus ``distractors_min..distractors_max`` tools drawn from the rest of the pool
  (generic tools and other domains' tools), shuffled.
- prices: each expert alias' $/1M input and output prices times one factor
  ``exp(U(-price_jitter, price_jitter))`` per alias.
- preference: ``accuracy ~ U(0.5, 1)``, ``cost ~ U(0, 1)``, ``latency ~ U(0, 1)`` and a weight
  ``U(0, 1)`` for 0-2 of the offered tools (not ``answer``).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field

from nemo_orchestra.synth.candidates import DOMAIN_CATEGORY, Candidate
from tools_env.domains import DOMAINS
from tools_env.task import TaskRecord

GENERIC_TOOLS = ("calculator", "python", "search", "expert", "answer")


def default_expert_prices() -> dict[str, tuple[float, float]]:
    """The tool service's default simulated experts and their prices ($/1M tokens in, out)."""
    from tools_env.service_config import ExpertsConfig

    cfg = ExpertsConfig()
    prices = {a: (e.price_in, e.price_out) for a, e in cfg.simulated.items()}
    prices.update({a: (e.price_in, e.price_out) for a, e in cfg.endpoints.items()})
    return prices


@dataclass
class RecordOptions:
    distractors_min: int = 1
    distractors_max: int = 4
    price_jitter: float = 0.5
    expert_prices: dict[str, tuple[float, float]] = field(default_factory=default_expert_prices)

    def validate(self) -> None:
        if not 0 <= self.distractors_min <= self.distractors_max:
            raise ValueError("distractors_min must be >= 0 and <= distractors_max")
        if self.price_jitter < 0:
            raise ValueError("price_jitter must be >= 0")


def tool_pool() -> list[str]:
    return list(GENERIC_TOOLS) + [d.tool_name(f) for d in DOMAINS.values() for f in d.functions]


def draw_tools(c: Candidate, rng: random.Random, opts: RecordOptions, pool: list[str]) -> list[str]:
    tools = list(dict.fromkeys(c.needed_tools))
    if "expert" not in tools and (c.category != DOMAIN_CATEGORY or rng.random() < 0.5):
        tools.append("expert")
    rest = [t for t in pool if t not in tools]
    tools += rng.sample(rest, min(len(rest), rng.randint(opts.distractors_min, opts.distractors_max)))
    rng.shuffle(tools)
    return tools


def draw_prices(rng: random.Random, opts: RecordOptions) -> dict[str, dict[str, float]]:
    out = {}
    for alias in sorted(opts.expert_prices):
        p_in, p_out = opts.expert_prices[alias]
        f = math.exp(rng.uniform(-opts.price_jitter, opts.price_jitter))
        out[alias] = {"input": round(p_in * f, 4), "output": round(p_out * f, 4)}
    return out


def draw_preference(rng: random.Random, tools: list[str]) -> dict:
    pref = {
        "accuracy": round(rng.uniform(0.5, 1.0), 3),
        "cost": round(rng.uniform(0.0, 1.0), 3),
        "latency": round(rng.uniform(0.0, 1.0), 3),
    }
    offered = sorted(t for t in tools if t != "answer")
    pref["tools"] = {
        t: round(rng.uniform(0.0, 1.0), 3) for t in rng.sample(offered, min(len(offered), rng.randint(0, 2)))
    }
    return pref


def make_record(c: Candidate, rng: random.Random, opts: RecordOptions, pool: list[str]) -> TaskRecord:
    tools = draw_tools(c, rng, opts, pool)
    record = TaskRecord(
        problem=c.problem,
        answer=c.answer,
        category=c.category,
        tools=tools,
        id=f"{c.domain or c.category}-{c.key()}",
        prices=draw_prices(rng, opts),
        preference=draw_preference(rng, tools),
        verifier=dict(c.verifier),
        domain=c.domain,
        gold_actions=list(c.gold_actions),
        meta=dict(c.meta),
    )
    return TaskRecord.from_dict(json.loads(record.to_json()))  # the record must pass the loader's checks


def content_hash(records: list[TaskRecord]) -> str:
    """sha256 over the records' canonical JSON lines, sorted (independent of split and order)."""
    h = hashlib.sha256()
    for line in sorted(r.to_json() for r in records):
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


def split(records: list[TaskRecord], eval_fraction: float) -> tuple[list[TaskRecord], list[TaskRecord]]:
    """Deterministic split: the ``round(n * eval_fraction)`` records with the smallest sha256(id) are eval."""
    order = sorted(records, key=lambda r: hashlib.sha256(r.id.encode()).hexdigest())
    n_eval = round(len(records) * eval_fraction)
    eval_ids = {r.id for r in order[:n_eval]}
    return [r for r in records if r.id not in eval_ids], [r for r in records if r.id in eval_ids]
