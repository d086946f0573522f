"""The policy interface of evaluation, the fixed routing baselines and the policy registry.

Every policy runs in the agent loop (``rollout/loop.py``), the one training uses. A policy sees
what an orchestrator sees — the episode's task (problem, prices, preference), its tool schemas and
the conversation so far — and produces the next turn. It never sees the gold answer (the
``oracle`` check policy is built from the task file instead).

Policies by spec (``POLICIES``, a plain dict of builders; ``build_policy("name:arg")``):

- ``strongest``: ask the expert alias with the highest output price (price stands in for
  strength, as in the paper's tables), then answer with what it said.
- ``cheapest``: the same with the alias of the lowest input + output price.
- ``random[:SEED]``: the same with a uniformly drawn alias.
- ``oracle``: replays each record's gold actions and submits its gold answer (a data check:
  every record must come out correct).
- ``openai:URL:MODEL``: an OpenAI-compatible chat model (see ``openai_policy``).
- ``checkpoint:DIR``: a trained orchestrator (a run folder or its ``hf/`` export; see ``checkpoint_policy``).
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable

from nemo_orchestra.prompting.chat import ToolCall
from nemo_orchestra.rollout.loop import Episode, Turn, TurnPolicy


class Policy:
    """A message-level policy of the agent loop (``rollout.loop.TurnPolicy``) deciding one episode at a
    time: ``decide`` returns the next call for one episode; ``act`` serves a batch."""

    name = "policy"
    chat = None  # works on messages, not token ids

    async def act(self, episodes: list[Episode]) -> list[Turn]:
        return [await self.turn(e) for e in episodes]

    async def turn(self, episode: Episode) -> Turn:
        return Turn("", call=self.decide(episode))  # no text before the call

    def decide(self, episode: Episode) -> ToolCall:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


_ANSWER_IS = re.compile(r"answer is\s*(.*?)\s*\.?\s*$", re.IGNORECASE | re.DOTALL)


def expert_reply_answer(observation: str) -> str:
    """The answer inside an expert's reply: after "answer is", else the text after "alias: "."""
    m = _ANSWER_IS.search(observation)
    if m:
        return m.group(1)
    return observation.split(": ", 1)[-1].strip()


class FixedRouting(Policy):
    """Ask one expert alias (chosen by ``choose``) the problem, then submit its answer."""

    def __init__(self, name: str, choose: Callable[[Episode], str]) -> None:
        self.name, self.choose = name, choose

    def decide(self, inp: Episode) -> ToolCall:
        aliases = inp.expert_aliases()
        if inp.turn == 0 and aliases:
            task = inp.task
            query = f"{task.system}\n\n{task.problem}" if task.system else task.problem
            return ToolCall("expert", {"model": self.choose(inp), "query": query})
        answer = expert_reply_answer(inp.last_observation()) if inp.turn > 0 else "I don't know"
        return ToolCall("answer", {"answer": answer})


def _price(inp: Episode, alias: str) -> tuple[float, float]:
    p = inp.task.prices.get(alias)
    if p:
        return float(p.get("input", 0.0)), float(p.get("output", 0.0))
    return _price_from_table(inp, alias)


def _price_from_table(inp: Episode, alias: str) -> tuple[float, float]:
    """Read ``| alias ... | in | out |`` from the expert tool's description (the service's table)."""
    for t in inp.tools:
        if t["function"]["name"] != "expert":
            continue
        for line in t["function"]["description"].splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 3 and cells[0].split(" ")[0] == alias:
                try:
                    return float(cells[1]), float(cells[2])
                except ValueError:
                    pass
    return 0.0, 0.0


def strongest(inp: Episode) -> str:
    return max(inp.expert_aliases(), key=lambda a: (_price(inp, a)[1], _price(inp, a)[0], a))


def cheapest(inp: Episode) -> str:
    return min(inp.expert_aliases(), key=lambda a: (sum(_price(inp, a)), a))


class RandomRouting(FixedRouting):
    def __init__(self, seed: int = 0) -> None:
        def choose(inp: Episode) -> str:  # per task and sample, so results do not depend on scheduling
            return random.Random(f"{seed}|{inp.task.id}|{inp.sample}").choice(sorted(inp.expert_aliases()))

        super().__init__("random", choose)


class Oracle(Policy):
    """Replays the gold actions of each record, then submits the gold answer (checks the data)."""

    name = "oracle"

    def __init__(self, tasks: list[dict[str, Any]]) -> None:
        self.gold = {t["id"]: t for t in tasks}

    def decide(self, inp: Episode) -> ToolCall:
        task = self.gold[inp.task.id]
        actions = task.get("gold_actions") or []
        if inp.turn < len(actions):
            a = actions[inp.turn]
            return ToolCall(a["name"], dict(a.get("arguments", {})))
        return ToolCall("answer", {"answer": task["answer"] or "done"})


def _checkpoint(arg: str | None, options: dict[str, Any]) -> TurnPolicy:
    from nemo_orchestra.evaluation.checkpoint_policy import checkpoint_policy, run_settings

    if not arg:
        raise ValueError("checkpoint policy spec is checkpoint:DIR (a run folder or its hf/ export)")
    kwargs = dict(options.get("checkpoint", {}))
    settings = run_settings(arg)
    if settings is not None:  # the run's own tokens per turn
        kwargs["max_new_tokens"] = settings.max_new_tokens
    return checkpoint_policy(arg, **kwargs)


def _openai(arg: str | None, options: dict[str, Any]) -> TurnPolicy:
    from nemo_orchestra.evaluation.openai_policy import OpenAIChatPolicy

    if not arg or ":" not in arg.replace("://", ""):
        raise ValueError("openai policy spec is openai:URL:MODEL, e.g. openai:http://127.0.0.1:8000/v1:qwen3-8b")
    url, model = arg.rsplit(":", 1)
    return OpenAIChatPolicy(url, model, **options.get("openai", {}))


POLICIES: dict[str, Callable[[str | None, dict[str, Any]], TurnPolicy]] = {
    "strongest": lambda arg, o: FixedRouting("strongest", strongest),
    "cheapest": lambda arg, o: FixedRouting("cheapest", cheapest),
    "random": lambda arg, o: RandomRouting(int(arg) if arg else o.get("seed", 0)),
    "oracle": lambda arg, o: Oracle(o.get("tasks", [])),
    "openai": _openai,
    "checkpoint": _checkpoint,
}


def build_policy(spec: str, options: dict[str, Any] | None = None) -> TurnPolicy:
    """``name`` or ``name:arg`` -> a policy of the agent loop; an unknown name lists the known ones."""
    name, _, arg = spec.partition(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}")
    policy = POLICIES[name](arg or None, options or {})
    if name == "random" and arg:
        policy.name = spec
    return policy
