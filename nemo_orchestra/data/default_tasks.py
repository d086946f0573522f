"""The embedded default task set: small, generated locally, with a right tool per category.

Categories (the service's default simulated experts are tuned to them):

- ``arithmetic``: "What is 37 * 12?" — the free, exact ``calculator`` is the right tool (its
  result then answered, or handed to a cheap expert to write the answer); the cheap expert alone
  is unreliable.
- ``lookup``: facts about fictional places — any expert knows them; the cheap one suffices.
- ``reasoning``: puzzles only the strong (expensive) expert solves reliably.

The final answer is the policy's own (``answer`` with ``answer``) or written by an expert
(``answer`` with ``model``), as in ToolOrchestra.

Each record carries its tool subset, per-alias prices perturbed around the paper's, and a
preference vector: cost-sensitive tasks weight cost and latency, accuracy-first tasks do not.
The policy sees the preference in the prompt.
"""

from __future__ import annotations

import random

from tools_env.task import TaskRecord

CATEGORIES = ("arithmetic", "lookup", "reasoning")
EXPERT_PRICES = {  # $/1M tokens (input, output), after the paper's price table
    "expert-small": (0.2, 0.2),
    "expert-medium": (0.8, 0.8),
    "expert-large": (1.25, 10.0),
}
PREFERENCES = {
    "accuracy_first": {"accuracy": 1.0, "cost": 0.1, "latency": 0.1},
    "cost_sensitive": {"accuracy": 1.0, "cost": 1.0, "latency": 0.5},
}
_SYL = ["ka", "lo", "mi", "ra", "te", "vo", "zu", "ne", "sha", "dri", "pel", "tor", "vin", "qua", "bel"]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYL) for _ in range(parts)).capitalize()


def _arithmetic(rng: random.Random) -> tuple[str, str, dict]:
    a, b = rng.randint(10, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", str(value), {"type": "numeric", "abs_tol": 1e-6}


def _lookup(rng: random.Random) -> tuple[str, str, dict]:
    country, city = _name(rng, 2), _name(rng, 2)
    kind = rng.choice(["capital", "largest port", "oldest university town"])
    return f"What is the {kind} of {country}?", city, {"type": "exact"}


def _reasoning(rng: random.Random) -> tuple[str, str, dict]:
    n = rng.randint(3, 9)
    who = _name(rng, 2)
    answer = _name(rng, 1)
    return (f"{who} hides a word after {n} riddles; each riddle names the next. Which word is it?",
            answer, {"type": "exact"})


_MAKERS = {"arithmetic": _arithmetic, "lookup": _lookup, "reasoning": _reasoning}


def make_task(rng: random.Random, category: str) -> TaskRecord:
    problem, answer, verifier = _MAKERS[category](rng)
    tools = ["calculator", "expert", "answer"] if category == "arithmetic" or rng.random() < 0.3 else ["expert", "answer"]
    prices = {
        alias: {"input": round(pin * rng.uniform(0.7, 1.3), 4), "output": round(pout * rng.uniform(0.7, 1.3), 4)}
        for alias, (pin, pout) in EXPERT_PRICES.items()
    }
    pref_name = rng.choice(sorted(PREFERENCES))
    return TaskRecord(
        problem=problem, answer=answer, category=category, tools=tools, prices=prices,
        preference=dict(PREFERENCES[pref_name]), verifier=verifier, meta={"preference_name": pref_name},
    )


def generate_tasks(n: int, seed: int) -> list[TaskRecord]:
    """``n`` tasks, categories in rotation, deterministic in ``seed``; ids unique within the set."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        task = make_task(rng, CATEGORIES[i % len(CATEGORIES)])
        task.id = f"default-{seed}-{i:05d}"
        tasks.append(task)
    return tasks


def system_prompt(pref: dict) -> str:
    """The orchestrator's system prompt, stating the user's preference weights."""
    weights = ", ".join(f"{k} {pref[k]:g}" for k in ("accuracy", "cost", "latency") if k in pref)
    return ("You are an orchestrator. Solve the task by calling tools, then call answer. "
            f"User preference weights: {weights}.")
