"""Task candidates with verifiable ground truth: QA categories and domain tasks.

A ``Candidate`` is a task before its tool subset, prices and preference are drawn. Every
answer is computed, never written by hand or by a model:

- ``arithmetic``: an integer expression; the answer is its value (numeric verifier).
- ``lookup``: a 2- or 3-hop question over the synthetic search corpus (fictional entities, so
  only searching answers it); ``meta.hops`` lists the query and document of each hop.
- ``reasoning``: "hard" computational questions (digit-sum counts, prime sums, modular powers,
  Fibonacci residues, divisor counts, staircase counts) that weak experts get wrong; the name
  matches the service's simulated-expert accuracy table (strong experts ~0.9, weak ~0.2).
- ``function_calling``: a ToolScale-style domain task; its gold actions are executed on the
  seeded database, and its answer (when it asks for information) is read from their results.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from tools_env.corpus import World
from tools_env.domains import DOMAINS, replay
from tools_env.domains.base import open_copy

QA_CATEGORIES = ("arithmetic", "lookup", "reasoning")
DOMAIN_CATEGORY = "function_calling"


@dataclass
class Candidate:
    problem: str
    answer: str
    category: str
    needed_tools: list[str]  # always offered; the record adds distractors
    verifier: dict[str, Any] = field(default_factory=lambda: {"type": "exact"})
    domain: str | None = None
    gold_actions: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        """Identity for de-duplication and the record id (the same question on another database differs)."""
        blob = json.dumps([self.problem, self.domain, self.verifier.get("db_seed")], sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]


# ---- arithmetic --------------------------------------------------------------------------


def _expr(rng: random.Random, depth: int) -> tuple[str, int]:
    if depth == 0:
        v = rng.randint(2, 99)
        return str(v), v
    (a, x), (b, y) = _expr(rng, depth - 1), _expr(rng, rng.randint(0, depth - 1))
    op = rng.choice("+-*")
    if op == "*" and abs(x * y) > 10**6:
        op = "+"
    value = {"+": x + y, "-": x - y, "*": x * y}[op]
    return f"({a} {op} {b})", value


def arithmetic(rng: random.Random) -> Candidate:
    text, value = _expr(rng, rng.randint(2, 3))
    text = text[1:-1]
    return Candidate(
        problem=f"Compute {text}. Answer with the exact integer.",
        answer=str(value),
        category="arithmetic",
        needed_tools=[rng.choice(["calculator", "python"]), "answer"],
        verifier={"type": "numeric"},
        meta={"expression": text},
    )


# ---- multi-hop lookup over the corpus ------------------------------------------------------


def lookup(rng: random.Random, world: World) -> Candidate:
    founders = sorted(p for p, v in world.people.items() if v["company"])
    person = rng.choice(founders)
    p = world.people[person]
    company = p["company"]
    c = world.companies[company]
    hop = lambda name: {"query": name, "doc_id": world.doc_id[name]}  # noqa: E731
    kind = rng.choice(["hq_city", "hq_country", "founder_born", "founder_university", "birth_capital"])
    if kind == "hq_city":
        q, a, hops = f"Which city is the company founded by {person} headquartered in?", c["city"], [person, company]
    elif kind == "hq_country":
        q = f"In which country is the headquarters of the company founded by {person}?"
        a, hops = world.cities[c["city"]]["country"], [person, company, c["city"]]
    elif kind == "founder_born":
        q, a, hops = f"In what year was the founder of {company} born?", str(p["born"]), [company, person]
    elif kind == "founder_university":
        q, a, hops = f"Which university did the founder of {company} attend?", p["university"], [company, person]
    else:
        country = world.cities[p["city"]]["country"]
        q = f"What is the capital of the country where {person} is from?"
        a, hops = world.countries[country]["capital"], [person, p["city"], country]
    verifier = {"type": "numeric"} if kind == "founder_born" else {"type": "exact"}
    return Candidate(
        problem=q,
        answer=a,
        category="lookup",
        needed_tools=["search", "answer"],
        verifier=verifier,
        meta={"hops": [hop(h) for h in hops], "kind": kind, "corpus_seed": world.seed},
    )


# ---- hard computational questions ----------------------------------------------------------


def _digit_sum_count(limit: int, s: int) -> int:
    """How many n in [1, limit] have digit sum s (digit DP over the decimal digits of limit)."""
    digits = [int(d) for d in str(limit)]
    ways: dict[tuple[int, bool], int] = {(0, True): 1}
    for d in digits:
        nxt: dict[tuple[int, bool], int] = {}
        for (acc, tight), w in ways.items():
            for x in range((d if tight else 9) + 1):
                if acc + x <= s:
                    key = (acc + x, tight and x == d)
                    nxt[key] = nxt.get(key, 0) + w
        ways = nxt
    return sum(w for (acc, _), w in ways.items() if acc == s) - (1 if s == 0 else 0)


def _prime_sum(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(range(i * i, n, i)))
    return sum(i for i in range(n) if sieve[i])


def _fib_mod(n: int, m: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    return a


def _stairs(n: int) -> int:
    w = [1, 1, 2]
    for i in range(3, n + 1):
        w.append(w[-1] + w[-2] + w[-3])
    return w[n]


def _divisors(primes: list[tuple[int, int]]) -> tuple[int, int]:
    n, count = 1, 1
    for p, e in primes:
        n *= p**e
        count *= e + 1
    return n, count


def reasoning(rng: random.Random) -> Candidate:
    kind = rng.choice(["digit_sum", "prime_sum", "modpow", "fib_mod", "stairs", "divisors"])
    if kind == "digit_sum":
        limit, s = rng.randint(10**4, 10**6), rng.randint(10, 30)
        q, a = (
            f"How many integers n with 1 <= n <= {limit} have a decimal digit sum of exactly {s}?",
            _digit_sum_count(limit, s),
        )
    elif kind == "prime_sum":
        n = rng.randint(2000, 30000)
        q, a = f"What is the sum of all prime numbers less than {n}?", _prime_sum(n)
    elif kind == "modpow":
        base, exp, mod = rng.randint(2, 999), rng.randint(10**6, 10**12), rng.randint(1000, 99991)
        q, a = f"What is the remainder when {base}^{exp} is divided by {mod}?", pow(base, exp, mod)
    elif kind == "fib_mod":
        n, m = rng.randint(1000, 50000), rng.randint(97, 9973)
        q, a = f"With F(0)=0 and F(1)=1, what is F({n}) modulo {m}?", _fib_mod(n, m)
    elif kind == "stairs":
        n = rng.randint(25, 60)
        q, a = f"In how many ways can you climb a staircase of {n} steps taking 1, 2 or 3 steps at a time?", _stairs(n)
    else:
        primes = sorted(rng.sample([2, 3, 5, 7, 11, 13, 17, 19, 23], rng.randint(3, 5)))
        n, a = _divisors([(p, rng.randint(1, 4)) for p in primes])
        q = f"How many positive divisors does {n} have?"
    return Candidate(
        problem=q + " Answer with the exact integer.",
        answer=str(a),
        category="reasoning",
        needed_tools=["python", "answer"],
        verifier={"type": "numeric"},
        meta={"kind": kind},
    )


# ---- domain tasks ------------------------------------------------------------------------

DOMAIN_PROMPT = (
    "[{domain}: {description}]\nPolicy: {policy}\n\n"
    "Customer: {scenario}\n\n"
    "Use the {domain} tools to handle the request within the policy. When you are done, call `answer` {ending}"
)


def domain_task(rng: random.Random, domain_name: str, db_seed: int) -> Candidate | None:
    """One task of ``domain_name`` on database ``db_seed``; None when the template drew nothing usable."""
    domain = DOMAINS[domain_name]
    db = open_copy(domain, db_seed)
    template = rng.choice(domain.templates)
    task = template(db, rng)
    db.conn.close()
    if task is None:
        return None
    actions = [{"name": domain.tool_name(a["name"]), "arguments": a["arguments"]} for a in task.gold_actions]
    final_db, results = replay(domain, db_seed, actions)
    final_db.conn.close()
    if any(isinstance(r, dict) and set(r) == {"error"} for r in results):
        return None  # a gold action the data refuses: the template is wrong for this database
    answer = task.answer(results) if task.answer else ""
    ending = (
        "with the information the customer asked for (just the value)."
        if answer
        else "with a one-line summary of what you did."
    )
    problem = DOMAIN_PROMPT.format(
        domain=domain.name, description=domain.description, policy=domain.policy, scenario=task.scenario, ending=ending
    )
    needed = [domain.tool_name(f) for f in domain.functions] + ["answer"]
    return Candidate(
        problem=problem,
        answer=answer,
        category=DOMAIN_CATEGORY,
        needed_tools=needed,
        verifier={"type": "db_state", "db_seed": db_seed},
        domain=domain.name,
        gold_actions=actions,
        meta={"kind": task.kind, "template": template.__name__, "scenario": task.scenario},
    )


GENERATORS: dict[str, Callable[..., Candidate | None]] = {
    "arithmetic": arithmetic,
    "lookup": lookup,
    "reasoning": reasoning,
    DOMAIN_CATEGORY: domain_task,
}
