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
                small = "expert-small"
                chains = [await _play(client, t, lambda t, o: chain_call(t, o, small, small)) for t in tasks]
                large = [await _play(client, t, lambda t, o: chain_call(t, o, "expert-large", small)) for t in tasks]
                experts = [await _play(client, t, _expert_large) for t in tasks]
            finally:
                await client.aclose()
            return chains, large, experts

        chains, large, experts = asyncio.run(main())
    for t, (turns, correct, cost), by_large in zip(tasks, chains, large):
        if t.meta["searchable"]:  # expert-small writes the answer from the two documents
            assert correct, t.problem
        assert turns == 3 and by_large[1] == correct and cost < by_large[2] < 0.002  # the dearer writer: same queries
        assert cost < 0.001
    missing = [c for t, (_, c, _) in zip(tasks, chains) if not t.meta["searchable"]]
    assert missing and sum(missing) < len(missing) / 2  # where a fact is missing expert-small rarely answers
    expert_cost = sum(cost for _, _, cost in experts) / len(experts)
    assert expert_cost > 5 * max(cost for _, _, cost in chains)
    assert sum(c for _, c, _ in experts) >= 0.8 * len(tasks)


def test_scripted_chains_have_experts_write_the_searches_and_the_answer_from_the_documents():
    """The warm start's chains: two searches whose queries an expert writes, then an expert writing the answer
    from the two results, each expert at random; where the world holds both documents the answer is right at
    the writer's odds with them (``evidence_accuracy``: 0.9 to 1.0), far above its odds without (0.1 to 0.95)."""
    from nemo_orchestra.data.warm_start import scripted_episodes

    service = dict(load_config([]).tools.service)
    tasks = generate_tasks(120, 5, "multistep")
    with start_service(service, workers=1, token=None, timeout_s=60) as handle:

        async def main():
            client = ToolsEnvClient(list(handle.urls))
            try:
                return await scripted_episodes(tasks, client, seed=3)
            finally:
                await client.aclose()

        episodes = asyncio.run(main())
    chains = [ep for ep in episodes if ep.turns[0][0] == "search"]
    assert len(chains) > 25
    right = {}
    for ep in chains:
        assert [n for n, _, _ in ep.turns] == ["search", "search", "answer"]
        assert ep.turns[0][1] == ep.turns[1][1] and set(ep.turns[2][1]) == {"model"}
        if ep.task.meta["searchable"]:
            right.setdefault(ep.turns[2][1]["model"], []).append(ep.turns[2][2].endswith(f"wrote: {ep.task.answer})."))
    assert len({ep.turns[2][1]["model"] for ep in chains}) == 3
    assert sum(map(sum, right.values())) >= 0.8 * sum(map(len, right.values()))  # 0.95 expected; 0.1-0.95 without
    assert right["expert-large"] and all(right["expert-large"])  # the strong writer with both documents: always right
