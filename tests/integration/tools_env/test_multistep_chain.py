"""Multi-step tasks through the real service with the default recipe's tools: the scripted chain (two searches
whose queries an expert writes, the calculator, the answer) is right exactly where the search tool's world
holds both facts, whichever expert writes, and costs a fraction of one expert-large call, which answers at
once."""

from __future__ import annotations

import asyncio

from nemo_orchestra.config import load_config
from nemo_orchestra.data.default_tasks import generate_tasks
from nemo_orchestra.data.warm_start import chain_call
from tools_env.client import ToolsEnvClient
from tools_env.supervisor import start_service


async def _play(client, task, route):
    ep = await client.create_episode(task.to_dict())
    observations, cost, result = [], 0.0, {}
    try:
        while not result.get("done"):
            name, args = route(task, observations)
            result = await client.step(ep["episode_id"], name, args)
            observations.append(str(result["observation"]))
            cost += float(result.get("cost", 0.0))
    finally:
        await client.delete_episode(ep["episode_id"])
    return len(observations), result["outcome"]["correct"], cost


def _expert_large(task, observations):
    return "answer", {"model": "expert-large"}


def test_the_chain_is_right_where_the_facts_are_found_and_costs_a_fraction_of_the_strong_expert():
    service = dict(load_config([]).tools.service)  # the default recipe's: local search at $0.0001, its best document
    tasks = generate_tasks(40, 11, "multistep")
    with start_service(service, workers=1, token=None, timeout_s=60) as handle:

        async def main():
            client = ToolsEnvClient(list(handle.urls))
            try:
                chains = [await _play(client, t, lambda t, o: chain_call(t, o, "expert-small")) for t in tasks]
                large = [await _play(client, t, lambda t, o: chain_call(t, o, "expert-large")) for t in tasks]
                experts = [await _play(client, t, _expert_large) for t in tasks]
            finally:
                await client.aclose()
            return chains, large, experts

        chains, large, experts = asyncio.run(main())
    for t, (turns, correct, cost), by_large in zip(tasks, chains, large):
        assert turns == 4 and correct == t.meta["searchable"], t.problem
        assert by_large[1] == correct and cost < by_large[2] < 0.002  # the dearer writer writes the same queries
        assert cost < 0.001
    assert sum(c for _, c, _ in chains) < len(tasks)  # some facts are missing from the world
    expert_cost = sum(cost for _, _, cost in experts) / len(experts)
    assert expert_cost > 5 * max(cost for _, _, cost in chains)
    assert sum(c for _, c, _ in experts) >= 0.8 * len(tasks)


def test_scripted_chains_end_either_way_at_even_odds_and_an_expert_finishing_one_has_the_documents():
    """The warm start's chains: two searches whose queries an expert writes, then the calculator or an expert
    writing the answer from the two results, at even odds; the expert's answer is right where the world
    holds both documents, whichever expert writes it."""
    from nemo_orchestra.data.warm_start import scripted_episodes

    service = dict(load_config([]).tools.service)
    tasks = generate_tasks(160, 5, "multistep")
    with start_service(service, workers=1, token=None, timeout_s=60) as handle:

        async def main():
            client = ToolsEnvClient(list(handle.urls))
            try:
                return await scripted_episodes(tasks, client, seed=3)
            finally:
                await client.aclose()

        episodes = asyncio.run(main())
    chains = [ep for ep in episodes if ep.turns[0][0] == "search"]
    by_expert = [ep for ep in chains if ep.turns[2][0] == "answer"]
    assert len(chains) > 30 and 0.3 < len(by_expert) / len(chains) < 0.7
    assert all(ep.turns[2][0] == "calculator" for ep in chains if ep not in by_expert)
    for ep in by_expert:
        assert [n for n, _, _ in ep.turns] == ["search", "search", "answer"] and "model" in ep.turns[2][1]
        assert ep.turns[2][1]["model"] in ("expert-small", "expert-medium", "expert-large")
        if ep.task.meta["searchable"]:  # elsewhere the expert answers at its skill (0.1 to 0.95)
            assert ep.turns[2][2].endswith(f"wrote: {ep.task.answer}).")
    small = [ep for ep in by_expert if ep.turns[2][1]["model"] == "expert-small"]
    assert sum(ep.turns[2][2].endswith(f"wrote: {ep.task.answer}).") for ep in small) < len(small)  # not always
