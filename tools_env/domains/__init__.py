"""ToolScale-style domains: seeded SQLite databases, policies and typed tools over them.

Each module holds one ``Domain`` (schema, seeded generator, policy, functions, task templates).
A domain function ``f`` of domain ``d`` is the service tool ``d_f`` (``bank_transfer``); the
tools are registered by ``tools_env.tools.domain``. A task record of a domain names the domain
in ``domain``, its database seed in ``verifier.db_seed`` (default 0) and its gold actions as
``[{"name": tool name, "arguments": {...}}]``.

``verify_db_state(ctx, task)`` replays the gold actions on a fresh copy of the seeded database
and compares every table with the episode's private copy. Importing this package registers it
as the ``db_state`` verifier type of ``tools_env.verify``.
"""

from __future__ import annotations

import os
from typing import Any

from tools_env.domains import (
    bank,
    basketball,
    ecommerce,
    medicine,
    movie,
    railway,
    restaurant,
    school,
    travel,
    weather,
)
from tools_env.domains import bfcl  # noqa: F401  (registers the bfcl verifier, or why it is unavailable)
from tools_env.domains import tau2  # noqa: F401  (registers the tau2 verifier, or why it is unavailable)
from tools_env.domains.base import DB, Domain, DomainError, diff_state, dump_state, open_copy
from tools_env.verify import Outcome, exact_match, numeric_match, parse_number, register_verifier

DOMAINS: dict[str, Domain] = {
    m.DOMAIN.name: m.DOMAIN
    for m in (bank, basketball, ecommerce, medicine, movie, railway, restaurant, school, travel, weather)
}


def get_domain(name: str) -> Domain:
    if name not in DOMAINS:
        raise KeyError(f"unknown domain '{name}'; known domains: {', '.join(sorted(DOMAINS))}")
    return DOMAINS[name]


def db_seed(task: Any) -> int:
    verifier = getattr(task, "verifier", None) or {}
    return int(verifier.get("db_seed", 0))


def episode_db_path(workdir: str, domain: str) -> str:
    return os.path.join(workdir, "domains", f"{domain}.sqlite")


def episode_db(ctx: Any, domain: Domain) -> DB:
    """The episode's private copy of the domain database, created on first use."""
    return open_copy(domain, db_seed(ctx.task), episode_db_path(ctx.workdir, domain.name))


def function_name(domain: Domain, tool_name: str) -> str:
    prefix = f"{domain.name}_"
    if not tool_name.startswith(prefix) or tool_name[len(prefix) :] not in domain.functions:
        raise KeyError(f"'{tool_name}' is not a tool of domain {domain.name}")
    return tool_name[len(prefix) :]


def replay(domain: Domain, seed: int, actions: list[dict[str, Any]], db: DB | None = None) -> tuple[DB, list[Any]]:
    """Run actions (tool names) on a fresh in-memory copy; a refused action's result is its error text."""
    db = db or open_copy(domain, seed)
    results = []
    for action in actions:
        fn = function_name(domain, action["name"])
        try:
            results.append(domain.call(db, fn, dict(action.get("arguments", {}))))
        except DomainError as e:
            results.append({"error": str(e)})
    return db, results


def verify_db_state(ctx: Any, task: Any) -> tuple[bool, str]:
    """Compare the episode's database with the gold actions replayed on a fresh seeded copy.

    When the task also expects an answer (``task.answer`` non-empty), the answer submitted in
    the episode (``ctx.state["final_answer"]``) must match it too: numerically when the gold
    answer is a number, else by normalized exact match (``verifier.answer_check`` overrides).
    """
    if not task.domain:
        return False, "task has no domain"
    try:
        domain = get_domain(task.domain)
        want_db, _ = replay(domain, db_seed(task), task.gold_actions)
    except (KeyError, TypeError) as e:
        return False, f"gold actions do not replay: {e}"
    path = episode_db_path(ctx.workdir, domain.name)
    got_db = open_copy(domain, db_seed(task), path if os.path.exists(path) else None)  # untouched: pristine
    try:
        diff = diff_state(dump_state(want_db), dump_state(got_db))
    finally:
        want_db.conn.close()
        got_db.conn.close()
    if diff:
        return False, diff
    if not task.answer:
        return True, "database state matches the gold actions"
    ok, reason = check_answer(str(ctx.state.get("final_answer", "")), task)
    return ok, f"database state matches; answer: {reason}"


def check_answer(pred: str, task: Any) -> tuple[bool, str]:
    mode = (task.verifier or {}).get("answer_check", "auto")
    if mode == "numeric" or (mode == "auto" and parse_number(task.answer) is not None):
        out = numeric_match(pred, task.answer, rel_tol=1e-9, abs_tol=1e-6)
    else:
        out = exact_match(pred, task.answer)
    return out.correct, out.reason


def db_state_verifier(answer: str, task: Any, ctx: Any, judge: Any) -> Outcome:
    """The ``db_state`` verifier type (``tools_env.verify.Verifier``); the answer is read from the episode."""
    correct, reason = verify_db_state(ctx, task)
    return Outcome(bool(correct), 1.0 if correct else 0.0, f"db_state: {reason}")


register_verifier("db_state", db_state_verifier)
