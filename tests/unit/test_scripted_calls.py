"""Scripted warm-start episodes with several calls (``warm_start.max_calls``): each makes 1 to max_calls tool
calls, never an answer in between, and then answers from its last result; one call is the default."""

import asyncio
from collections import Counter

import pytest

from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.data.default_tasks import generate_tasks
from nemo_orchestra.data.warm_start import scripted_episodes

ALIASES = ["expert-small", "expert-large"]
TOOLS = [
    {"function": {"name": "calculator", "description": "", "parameters": {"properties": {"expression": {}}}}},
    {
        "function": {
            "name": "expert",
            "description": " ".join(f"{a} (simulated)" for a in ALIASES),
            "parameters": {"properties": {"model": {"enum": ALIASES}, "query": {}}},
        }
    },
    {
        "function": {
            "name": "answer",
            "description": "",
            "parameters": {"properties": {"answer": {}, "model": {"enum": ALIASES}}},
        }
    },
]


class ScriptClient:
    """The service's episode calls: every tool returns "The answer is <n>." with n counting the calls."""

    def __init__(self):
        self.calls = 0

    async def create_episode(self, task):
        return {"episode_id": task["id"], "tools": TOOLS}

    async def step(self, episode_id, name, args):
        self.calls += 1
        return {"observation": f"The answer is {self.calls}.", "done": name == "answer"}

    async def delete_episode(self, episode_id):
        pass


def _episodes(max_calls, n=120):
    return asyncio.run(scripted_episodes(generate_tasks(n, 5), ScriptClient(), seed=3, max_calls=max_calls))


def test_episodes_make_one_to_max_calls_calls_and_answer_from_the_last():
    episodes = _episodes(3)
    calls = Counter()
    for ep in episodes:
        names = [name for name, _, _ in ep.turns]
        assert names[-1] == "answer" and "answer" not in names[:-1]
        if len(names) > 1:
            calls[len(names) - 1] += 1
            final = ep.turns[-1][1]
            if "answer" in final:  # answered with what the last call returned
                assert final["answer"] == ep.turns[-2][2].removeprefix("The answer is ").rstrip(".")
    assert set(calls) == {1, 2, 3} and min(calls.values()) > 10  # each count drawn


def test_one_call_is_the_default_and_draws_the_same_episodes():
    one = _episodes(1)
    assert all(len(ep.turns) <= 2 for ep in one)
    default = asyncio.run(scripted_episodes(generate_tasks(120, 5), ScriptClient(), seed=3))
    assert [ep.turns for ep in one] == [ep.turns for ep in default]


def test_the_calls_and_the_answer_must_fit_the_rollouts_turns():
    with pytest.raises(ConfigError, match="warm_start.max_calls"):
        load_config(["warm_start.max_calls=3", "rollout.max_turns=3"])
    assert load_config(["warm_start.max_calls=3", "rollout.max_turns=4"]).warm_start.max_calls == 3
    assert load_config(["rollout.max_turns=1"]).warm_start.max_calls == 1  # the default: one-turn rollouts as before
