"""Sampling whose draws belong to the sequence: with a seed per prompt, a sequence's tokens are the
same alone, in any batch and in any order; the in-process engines draw the same tokens from the same
seeds; and the agent loop gives each turn a seed of its own, so a run's rollouts do not depend on
how its tool calls interleave."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from nemo_orchestra.data.default_tasks import generate_tasks
from nemo_orchestra.export.qwen3 import full_state_dict
from nemo_orchestra.prompting.chat import ChatFormat, format_tool_call
from nemo_orchestra.rollout.engines.base import Generation
from nemo_orchestra.rollout.engines.hf import HFEngine
from nemo_orchestra.rollout.engines.megatron import MegatronEngine
from nemo_orchestra.rollout.engines.sampling import row_generators, sample_rows
from nemo_orchestra.rollout.loop import EnginePolicy, LoopLimits, run_episodes, turn_seed
from tests.integration.test_agent_loop import TOKENIZERS
from tests.integration.test_megatron_engine import VOCAB, make_prompts, new_policy
from tools_env.client import ToolsEnvClient
from tools_env.supervisor import start_service

CPU = torch.device("cpu")
SEEDS = [11, 2**62 + 5, 0, 987654321]


# ---- the exponential race -------------------------------------------------------------------------
def test_a_row_draws_each_token_with_its_probability():
    probs = torch.tensor([[0.1, 0.2, 0.7, 0.0]])
    (g,) = row_generators([5], CPU)
    draws = torch.cat([sample_rows(probs, [g]) for _ in range(20000)])
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, probs[0], atol=0.015, rtol=0)  # 5 standard deviations at 0.7
    assert freq[3] == 0  # a token of probability 0 is never drawn


def test_a_rows_draws_do_not_depend_on_the_other_rows():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)
    together = sample_rows(probs, row_generators(SEEDS, CPU))
    gens = row_generators(SEEDS, CPU)
    steps = torch.stack([sample_rows(probs, gens) for _ in range(6)])  # 6 draws of each row together
    for i, seed in enumerate(SEEDS):
        (g,) = row_generators([seed], CPU)
        alone = torch.stack([sample_rows(probs[i : i + 1], [g])[0] for _ in range(6)])
        assert torch.equal(alone, steps[:, i])
        assert together[i] == steps[0, i]
    order = [3, 1, 0, 2]
    reordered = sample_rows(probs[order], row_generators([SEEDS[i] for i in order], CPU))
    assert torch.equal(reordered, together[order])
    assert len(set(steps[:, 0].tolist())) > 1  # the generator moves on between steps


def test_sample_rows_refuses_a_generator_count_that_is_not_the_rows():
    with pytest.raises(ValueError, match="3 rows but 2 generators"):
        sample_rows(torch.full((3, 4), 0.25), row_generators([1, 2], CPU))


# ---- the in-process engines -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines():
    cfg, policy = new_policy()
    megatron = MegatronEngine(policy.module, CPU, seed=3)
    tok = SimpleNamespace(get_vocab=dict, eos_token_id=1, pad_token_id=0)
    hf = HFEngine(cfg.model, VOCAB, tok, CPU)
    hf.load_weights(full_state_dict(policy.module))
    return SimpleNamespace(megatron=megatron, hf=hf, prompts=make_prompts())


@pytest.mark.parametrize("name", ["hf", "megatron"])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_a_seeded_sequence_is_the_same_alone_in_a_batch_and_reordered(engines, name, top_p):
    engine, prompts = getattr(engines, name), engines.prompts
    batch = engine.generate(prompts, 10, 1.0, top_p, [], seeds=SEEDS)
    again = engine.generate(prompts, 10, 1.0, top_p, [], seeds=SEEDS)
    assert [g.token_ids for g in batch] == [g.token_ids for g in again]
    for p, seed, g in zip(prompts, SEEDS, batch):
        (alone,) = engine.generate([p], 10, 1.0, top_p, [], seeds=[seed])
        assert alone.token_ids == g.token_ids
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(g.logprobs), atol=1e-5, rtol=0)
    reordered = engine.generate(prompts[::-1], 10, 1.0, top_p, [], seeds=SEEDS[::-1])
    assert [g.token_ids for g in reordered[::-1]] == [g.token_ids for g in batch]
    other = engine.generate(prompts, 10, 1.0, top_p, [], seeds=[s + 1 for s in SEEDS])
    assert [g.token_ids for g in other] != [g.token_ids for g in batch]


def test_the_in_process_engines_draw_the_same_tokens_from_the_same_seeds(engines):
    """The same weights and seeds: the hf and megatron engines sample the same sequences, with top-p
    and without (both draw the exponential race from a generator per sequence)."""
    for top_p in (1.0, 0.8):
        hf = engines.hf.generate(engines.prompts, 12, 0.7, top_p, [], seeds=SEEDS)
        megatron = engines.megatron.generate(engines.prompts, 12, 0.7, top_p, [], seeds=SEEDS)
        assert [g.token_ids for g in hf] == [g.token_ids for g in megatron]
        for a, b in zip(hf, megatron):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["hf", "megatron"])
def test_a_nucleus_of_one_token_samples_the_greedy_sequence(engines, name):
    engine = getattr(engines, name)
    greedy = engine.generate(engines.prompts, 10, 0.0, 1.0, [])
    narrow = engine.generate(engines.prompts, 10, 1.0, 1e-6, [], seeds=SEEDS)
    assert [g.token_ids for g in narrow] == [g.token_ids for g in greedy]


@pytest.mark.parametrize("name", ["hf", "megatron"])
def test_seeds_must_be_one_per_prompt_and_in_range(engines, name):
    engine = getattr(engines, name)
    with pytest.raises(ValueError, match="3 seeds for 4 prompts"):
        engine.generate(engines.prompts, 4, 1.0, 1.0, [], seeds=SEEDS[:3])
    with pytest.raises(ValueError, match=r"seed -1 is not an integer in \[0, 2\*\*63\)"):
        engine.generate(engines.prompts, 4, 1.0, 1.0, [], seeds=[1, 2, 3, -1])


# ---- the agent loop -------------------------------------------------------------------------------
CALLS = [
    format_tool_call("calculator", {"expression": "6 * 7"}),
    format_tool_call("answer", {"answer": "42"}),
    format_tool_call("answer", {"answer": "41"}),
    "no call at all",  # a format error: the episode goes on
]


class SeededScript:
    """Writes the turn its seed picks from CALLS (as the tokenizer encodes it), recording each call's
    batch and the seeds it was given."""

    def __init__(self, chat: ChatFormat):
        self.chat, self.batches = chat, []

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop_ids, seeds=None):
        assert seeds is not None and len(seeds) == len(prompts)
        self.batches.append(list(seeds))
        out = []
        for seed in seeds:
            ids = self.chat.encode(CALLS[seed % len(CALLS)]) + [stop_ids[0]]
            out.append(Generation(ids, [-0.5] * len(ids), True))
        return out


@pytest.fixture(scope="module")
def service():
    with start_service({}) as handle:
        yield handle.urls


def _rollouts(service, chat, tasks, concurrency, seed="run/3"):
    engine = SeededScript(chat)
    policy = EnginePolicy(engine, chat, max_new_tokens=64, temperature=1.0)
    client = ToolsEnvClient(service)

    async def go():
        try:
            return await run_episodes(
                tasks,
                policy,
                client,
                samples=3,
                limits=LoopLimits(max_turns=4),
                default_preference={"accuracy": 1.0, "cost": 0.5, "latency": 0.5},
                seed=seed,
                concurrency=concurrency,
            )
        finally:
            await client.aclose()

    return asyncio.run(go()), engine.batches


def test_a_runs_rollouts_do_not_depend_on_how_its_episodes_are_batched(service):
    tasks = generate_tasks(8, seed=5)
    chat = ChatFormat(TOKENIZERS["embedded"]())
    all_at_once, wide = _rollouts(service, chat, tasks, None)
    two_at_a_time, narrow = _rollouts(service, chat, tasks, 2)
    assert max(map(len, wide)) > 2 and max(map(len, narrow)) <= 2  # the batches did differ
    assert [t.token_ids for t in all_at_once] == [t.token_ids for t in two_at_a_time]
    assert [t.reward for t in all_at_once] == [t.reward for t in two_at_a_time]
    assert max(len(t.turns) for t in all_at_once) > 1
    for t in all_at_once:  # each call's latency as its step reported it, summing to the service's total
        assert len(t.call_latencies_s) == len(t.turns) - t.format_errors
        assert sum(t.call_latencies_s) == pytest.approx(t.latency_s, abs=1e-9)
    seeds = [s for batch in wide for s in batch]
    assert len(set(seeds)) == len(seeds)  # every (episode, turn) its own seed: samples and turns differ
    other, _ = _rollouts(service, chat, tasks, None, seed="run/4")
    assert [t.token_ids for t in other] != [t.token_ids for t in all_at_once]


def test_without_seed_per_turn_the_engine_draws_from_its_own_generator():
    seen = []

    class Recording:
        def generate(self, prompts, max_new_tokens, temperature, top_p, stop_ids, seeds=None):
            seen.append(seeds)
            return [Generation([stop_ids[0]], [-0.1], True) for _ in prompts]

    chat = ChatFormat(TOKENIZERS["embedded"]())
    episodes = [SimpleNamespace(seed=f"s/{k}", turn=0, traj=SimpleNamespace(token_ids=[1, 2])) for k in range(3)]
    for flag in (True, False):
        policy = EnginePolicy(Recording(), chat, max_new_tokens=4, temperature=1.0, seed_per_turn=flag)
        asyncio.run(policy.act(episodes))
    assert seen[0] == [turn_seed(e) for e in episodes] and seen[1] is None


def test_turn_seeds_depend_on_the_episode_the_turn_and_the_salt_only():
    ep = SimpleNamespace(seed="1234/7/0/5", turn=2)
    first = turn_seed(ep)
    assert first == turn_seed(SimpleNamespace(seed="1234/7/0/5", turn=2)) and 0 <= first < 2**63
    assert first != turn_seed(SimpleNamespace(seed="1234/7/0/5", turn=3))
    assert first != turn_seed(SimpleNamespace(seed="1234/7/0/6", turn=2))
    assert first != turn_seed(ep, "1")
