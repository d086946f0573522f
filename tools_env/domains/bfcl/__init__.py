"""BFCL multi-turn tasks: the Berkeley Function Calling Leaderboard's executable APIs as a domain.

The data and the API classes come from the ``bfcl-eval`` package (BFCL v4, release
``BFCL_VERSION``), installed without its declared dependencies by the ``bfcl`` extra (numpy
pins, sentence-transformers, faiss and vendor SDKs are needed by its model handlers, not by the
data or the eight multi-turn API classes, which need ``mpmath`` only). Everything that touches
the package goes through ``require_bfcl``, so a BFCL task on a machine without it is one clear
error naming the extra.

- ``package``: the version, and ``require_bfcl``.
- ``apis``: the API classes, their function docs as tool schemas, BFCL's call strings parsed.
- ``checker``: our implementation of BFCL's multi-turn checker, turn by turn.
- ``tools``: every API function as a service tool; an episode's calls run on its own instances.
- ``importer``: BFCL entries as task records (``recipes/import_bfcl.py``).

A BFCL task record (``recipes/import_bfcl.py`` writes them) has ``domain: "bfcl"``, a
``verifier`` of type ``bfcl``, the first user turn as ``problem`` and the entry in
``meta["bfcl"]`` (``id``, ``category``, ``involved_classes``, ``initial_config``,
``long_context``, ``turns``: the user turns, ``ground_truth``: BFCL's call strings per turn).
``answer`` ends a user turn: the turn is checked and, when the entry has more turns, the next
user turn comes back as the answer's observation; after the last turn the episode ends and the
``bfcl`` verifier reports every failed turn.
"""

from __future__ import annotations

from typing import Any

from tools_env.domains.bfcl.checker import end_turn, final_outcome
from tools_env.domains.bfcl.package import BFCL_VERSION, EXTRA_HINT, BfclUnavailable, available, require_bfcl
from tools_env.verify import Outcome, register_turn_hook, register_unavailable, register_verifier

__all__ = ["BFCL_VERSION", "EXTRA_HINT", "BfclUnavailable", "available", "require_bfcl"]


def bfcl_verifier(answer: str, task: Any, ctx: Any, judge: Any) -> Outcome:
    """The ``bfcl`` verifier type: every user turn passed BFCL's checks (see ``checker``); each user turn's
    verdict in ``turn_passed`` (per-turn credit's outcome terms)."""
    correct, reason, passed = final_outcome(ctx)
    return Outcome(correct, 1.0 if correct else 0.0, f"bfcl: {reason}", turn_passed=passed)


def bfcl_turn_hook(answer: str, task: Any, ctx: Any, user: Any = None) -> str | None:
    """``answer`` ended a user turn: check it; the next user turn's text, or None after the last."""
    return end_turn(ctx)


_ok, _why = available()
if _ok:
    register_verifier("bfcl", bfcl_verifier)
    register_turn_hook("bfcl", bfcl_turn_hook)
else:
    register_unavailable("bfcl", _why)
