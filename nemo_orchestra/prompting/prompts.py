"""The orchestrator's prompt: the OpenAI-style ``messages`` an episode starts from.

One function builds them (``task_messages``) for every path: training rollouts, the warm start,
held-out evaluation and ``evaluate.py`` for every policy. The chat template the tokenizer carries
(and the export ships) renders these messages with the episode's ``tools``, so a policy served
by an OpenAI-compatible server that is sent the same messages and tools reads the prompt
training used, token for token.

A task without a preference vector takes ``default_preference`` (the reward's
``reward.default_preference``) before anything reads it: the prompt, the tool service and the
reward all see the same vector.
"""

from __future__ import annotations

import dataclasses

from nemo_orchestra.prompting.preferences import PREFERENCES
from tools_env.task import TaskRecord

SYSTEM_PROMPT = (
    "You are an orchestrator. Solve the task by calling tools, then call answer. "
    "Weigh accuracy, cost and latency as the user's preference says."
)


def preference_line(pref: dict, name: str | None = None) -> str:
    """The user's preference as the policy reads it: the weights, and in words when ``name`` is a
    profile of the default task set."""
    weights = ", ".join(f"{k} {pref[k]:g}" for k in ("accuracy", "cost", "latency") if k in pref)
    words = f" I want {PREFERENCES[name].wish}." if name in PREFERENCES else ""
    return f"Preference weights: {weights}.{words}"


def orchestrator_messages(problem: str, pref: dict, name: str | None = None, system: str | None = None) -> list[dict]:
    """The system prompt (followed by the task's own instructions ``system``, where it has some), then
    the problem followed by the preference. The preference closes the prompt, right before the
    policy's first turn, so even a tiny policy reads it where it decides."""
    return [
        {"role": "system", "content": f"{SYSTEM_PROMPT}\n\n{system}" if system else SYSTEM_PROMPT},
        {"role": "user", "content": f"{problem}\n\n{preference_line(pref, name)}"},
    ]


def with_default_preference(task: TaskRecord, default_preference: dict) -> TaskRecord:
    """``task`` itself when it states a preference, else a copy holding ``default_preference``."""
    if task.preference:
        return task
    return dataclasses.replace(task, preference=dict(default_preference))


def task_messages(task: TaskRecord) -> list[dict]:
    """The messages an episode of ``task`` starts from (its preference already filled in)."""
    return orchestrator_messages(task.problem, task.preference, task.meta.get("preference_name"), task.system)
