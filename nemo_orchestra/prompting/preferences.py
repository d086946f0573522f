"""Named preference profiles: a reward preference vector, how a user states it in the prompt, and the
word the orchestrator restates it with in its plan. A task record names its profile in
``meta["preference_name"]``; the default task set draws one per task (``data/default_tasks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    weights: dict  # the reward's preference vector
    wish: str  # how the user states it in the prompt
    label: str  # how the orchestrator restates it in its plan, in a word


PREFERENCES = {
    "accuracy_first": Profile(
        {"accuracy": 1.0, "cost": 0.0, "latency": 0.0}, "the most accurate answer, whatever it costs", "accurate"
    ),
    "cost_sensitive": Profile(
        {"accuracy": 1.0, "cost": 1.0, "latency": 0.5}, "a correct answer at low cost and latency", "cheap"
    ),
}
