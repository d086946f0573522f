"""Per-turn credit (``advantage.credit=turn``): unbiased where the field's per-turn-index normalisation is
not, with less variance than the episode's credit; the same as the episode's for single-turn groups; a
function of the rollouts alone (the same at K=0 and K=1); each turn's advantage on its own tokens."""

from dataclasses import replace

import numpy as np
import pytest

from nemo_orchestra.config import load_config
from nemo_orchestra.grpo.advantages import assign_advantages, turn_advantages
from nemo_orchestra.rollout.loop import FORMAT_ERROR_TURN, turn_key
from nemo_orchestra.types import TurnRecord
from tests.helpers import traj

# ---- a small orchestration problem whose policy gradient is computed exactly -------------------------------
# Turn 1: guess (ends), or call a tool: calc (free), small ($0.3) or large ($1.0); each returns a right or a
# wrong result. Turn 2, having seen it: answer with it (ends), or check with large ($0.5; then the answer,
# no choice, at turn 3). Reward: correct * (1 - 0.5 * cost). Episodes have 1, 2 or 3 turns.
FIRST = ["guess", "calc", "small", "large"]
SECOND = ["answer", "check"]
RIGHT = {"calc": 0.97, "small": 0.9, "large": 0.99}
COST = {"guess": 0.0, "calc": 0.0, "small": 0.3, "large": 1.0}
CHECK_COST, CHECK_RIGHT, GUESS_RIGHT = 0.5, 0.95, 0.2
STATES = ["start"] + [f"{k}/{o}" for k in RIGHT for o in ("right", "wrong")]
ACTIONS = {s: FIRST if s == "start" else SECOND for s in STATES}
INDEX = {(s, a): i for i, (s, a) in enumerate((s, a) for s in STATES for a in ACTIONS[s])}
FIRST_TURN = [INDEX[("start", a)] for a in FIRST]  # the parameters of the first decision
LATER = [i for i in range(len(INDEX)) if i not in FIRST_TURN]  # of the decision after a tool's result


def _policy(theta):
    out = {}
    for s in STATES:
        z = np.array([theta[INDEX[(s, a)]] for a in ACTIONS[s]])
        p = np.exp(z - z.max())
        out[s] = p / p.sum()
    return out


def _score(pi, s, a):
    g = np.zeros(len(INDEX))
    for b, p in zip(ACTIONS[s], pi[s]):
        g[INDEX[(s, b)]] -= p
    g[INDEX[(s, a)]] += 1.0
    return g


def _reward(correct, cost):
    return float(correct) * (1.0 - 0.5 * cost)


def _exact_gradient(theta):
    """The sum over every path (actions and results) of P(path) * R * grad log P(path)."""
    pi, grad = _policy(theta), np.zeros(len(INDEX))
    for a, pa in zip(FIRST, pi["start"]):
        s0 = _score(pi, "start", a)
        if a == "guess":
            grad += pa * GUESS_RIGHT * _reward(True, 0.0) * s0
            continue
        for right, po in ((True, RIGHT[a]), (False, 1 - RIGHT[a])):
            s = f"{a}/{'right' if right else 'wrong'}"
            for b, pb in zip(SECOND, pi[s]):
                score = s0 + _score(pi, s, b)
                if b == "answer":
                    grad += pa * po * pb * _reward(right, COST[a]) * score
                else:
                    grad += pa * po * pb * CHECK_RIGHT * _reward(True, COST[a] + CHECK_COST) * score
    return grad


def _episode(pi, rng):
    """(states, actions, each turn's cost, correct) of one sampled episode."""
    a = FIRST[rng.choice(4, p=pi["start"])]
    if a == "guess":
        return ["start"], [a], [0.0], rng.random() < GUESS_RIGHT
    s = f"{a}/{'right' if rng.random() < RIGHT[a] else 'wrong'}"
    b = SECOND[rng.choice(2, p=pi[s])]
    if b == "answer":
        return ["start", s], [a, b], [COST[a], 0.0], s.endswith("right")
    return ["start", s, "forced"], [a, b, "answer"], [COST[a], CHECK_COST, 0.0], rng.random() < CHECK_RIGHT


def _field_per_turn_index(rewards, keys):
    """The biased variant: each turn normalised over the rollouts that reached its index, itself included."""
    out = []
    for i, own in enumerate(keys):
        advs = []
        for t in range(len(own)):
            reached = [rewards[j] for j in range(len(keys)) if len(keys[j]) > t]
            std = np.std(reached, ddof=1) if len(reached) > 1 else 0.0
            advs.append((rewards[i] - np.mean(reached)) / (std + 1e-6))
        out.append(advs)
    return out


def _estimates(theta, credit, groups, n=8, seed=0):
    """One policy-gradient estimate per group of n rollouts, each rollout's score weighted turn by turn."""
    pi, rng = _policy(theta), np.random.default_rng(seed)
    out = np.zeros((groups, len(INDEX)))
    for g in range(groups):
        eps = [_episode(pi, rng) for _ in range(n)]
        rewards, keys, costs = [_reward(e[3], sum(e[2])) for e in eps], [e[1] for e in eps], [e[2] for e in eps]

        def spliced(i, j, t):  # rollout i's turns before t, rollout j's from t on
            return _reward(eps[j][3], sum(costs[i][:t]) + sum(costs[j][t:]))

        if credit == "turn":
            advs = turn_advantages(rewards, keys, "mean", 0.0, spliced)
        elif credit == "episode":
            advs = [[r - np.mean(rewards)] * len(k) for r, k in zip(rewards, keys)]
        else:
            advs = _field_per_turn_index(rewards, keys)
        for (states, actions, _, _), a in zip(eps, advs):
            for s, act, adv in zip(states, actions, a):
                if s != "forced":
                    out[g] += adv * _score(pi, s, act)
        out[g] /= n
    return out


def test_per_turn_credit_is_unbiased_with_less_variance_and_the_per_index_variant_is_biased():
    theta = np.random.default_rng(3).normal(0.0, 0.7, len(INDEX))
    truth = 7 / 8 * _exact_gradient(theta)  # (n-1)/n: both credits' scale with a group-mean baseline
    turn, episode = _estimates(theta, "turn", 12000), _estimates(theta, "episode", 12000)
    for est in (turn, episode):
        se = est.std(axis=0, ddof=1) / np.sqrt(len(est))
        assert np.all(np.abs(est.mean(axis=0) - truth) <= 4.5 * se + 1e-12)
    # the first decision is credited alike; every later one with less variance
    assert np.allclose(turn[:, FIRST_TURN], episode[:, FIRST_TURN])
    assert turn[:, LATER].var(axis=0).sum() < 0.9 * episode[:, LATER].var(axis=0).sum()
    field = _estimates(theta, "field", 12000)
    mean, se = field.mean(axis=0), field.std(axis=0, ddof=1) / np.sqrt(len(field))
    best = (mean @ truth) / (truth @ truth) * truth  # the gradient at the scale that fits best: still off
    assert np.max(np.abs(mean - best) / (se + 1e-12)) > 8


# ---- the same as the episode's where it must be --------------------------------------------------------------


def _group(rewards, keys, group=0):
    out = []
    for r, k in zip(rewards, keys):
        t = traj(group=group)
        t.reward = r
        t.turns = [TurnRecord(key=key, start=3 * j) for j, key in enumerate(k)]
        t.token_ids, t.loss_mask = [1] * (3 * len(k)), [1] * (3 * len(k))
        t.gen_logprobs = [0.0] * len(t.token_ids)
        out.append(t)
    return out


@pytest.mark.parametrize("mode", ["std", "mean", "loo"])
def test_a_single_turn_group_gets_the_episodes_advantages(mode):
    cfg = load_config([f"advantage.mode={mode}", "advantage.min_group_std=-1", "advantage.credit=episode"]).advantage
    rewards = [0.9, 0.1, 0.5, 0.5, 0.0]
    keys = [["a"], ["b"], ["a"], ["c"], ["b"]]
    episode, _ = assign_advantages(_group(rewards, keys), cfg)
    turned, metrics = assign_advantages(_group(rewards, keys), replace(cfg, credit="turn"))
    assert metrics["advantage/turn_credited_share"] == 1.0
    lesson = _group([0.5], [["a"]], group=0)[0]
    lesson.turns = []  # no per-turn records (a warm-start lesson): its group keeps the episode's credit
    _, partial = assign_advantages([*_group(rewards, keys, group=1), lesson], replace(cfg, credit="turn"))
    assert partial["advantage/turn_credited_share"] == 5 / 6
    assert [t.turn_advantages for t in episode] == [None] * 5
    assert [len(t.turn_advantages) for t in turned] == [1] * 5
    assert [t.turn_advantages[0] for t in turned] == pytest.approx([t.advantage for t in episode], abs=1e-6)


def test_later_turns_are_baselined_on_the_rollouts_that_acted_the_same_before_them():
    rewards = [1.0, 0.0, 0.6, 0.2]
    keys = [["x", "answer"], ["x", "answer"], ["y", "answer", "answer"], ["y", "z"]]
    adv = turn_advantages(rewards, keys, "loo", 0.0)
    assert adv[0] == pytest.approx([1.0 - (0.0 + 0.6 + 0.2) / 3, 1.0 - 0.0])  # turn 2: rollout 1 did "x" too
    assert adv[2] == pytest.approx([0.6 - 0.4, 0.6 - 0.2, 0.6 - 0.2])  # no one did "y", "answer": keep the longest
    assert adv[3] == pytest.approx([0.2 - (1.0 + 0.0 + 0.6) / 3, 0.2 - 0.6])


def test_the_same_rollouts_get_the_same_turn_advantages_at_any_staleness():
    cfg = replace(load_config(["advantage.min_group_std=-1"]).advantage, credit="turn")
    rewards, keys = [1.0, 0.0, 0.6, 0.2], [["x", "a"], ["x", "b"], ["y", "a", "a"], ["y"]]
    fresh, stale = _group(rewards, keys), _group(rewards, keys)
    for t in stale:
        for r, version in zip(t.turns, [5, 6, 6]):  # written one and two versions back
            r.version = version
    assign_advantages(fresh, cfg)
    assign_advantages(stale, cfg)
    assert [t.turn_advantages for t in fresh] == [t.turn_advantages for t in stale]


def test_each_turns_advantage_lands_on_its_own_targets():
    from nemo_orchestra.train.packing import pack

    t = traj()
    # prompt (3), turn 1 (2 generated), observation (2), turn 2 (3 generated)
    t.token_ids = list(range(10, 20))
    t.loss_mask = [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    t.gen_logprobs = [0.0] * 10
    t.prompt_len, t.turns = 3, [TurnRecord(key="a", start=3), TurnRecord(key="b", start=7)]
    t.advantage, t.turn_advantages = 0.5, [2.0, -1.0]
    (batch,) = pack([t], 64)
    trained = batch.loss_mask_T.bool()
    # position p predicts token p + 1: the targets of turn 1 are tokens 3-4, of turn 2 tokens 7-9
    assert batch.advantages_T[trained].tolist() == [2.0, 2.0, -1.0, -1.0, -1.0]


def test_a_turns_key_is_its_choice_not_its_wording():
    from nemo_orchestra.prompting.chat import ToolCall as Call

    tools = [
        {"function": {"name": "expert", "parameters": {"properties": {"model": {"enum": ["s", "l"]}, "query": {}}}}}
    ]
    one = turn_key([Call("expert", {"model": "s", "query": "What is 2+2?"})], tools)
    assert one == turn_key([Call("expert", {"model": "s", "query": "2 + 2 = ?"})], tools)
    assert one != turn_key([Call("expert", {"model": "l", "query": "What is 2+2?"})], tools)
    assert FORMAT_ERROR_TURN not in (one,)


def test_per_user_turn_verdicts_zero_the_turns_after_a_failed_user_turn():
    """BFCL-like: 2 user turns, each a call then an answer (agent turns 0-1 and 2-3). The outcome needs both."""
    cfg = load_config(["advantage.min_group_std=-1", "reward=outcome_only", "advantage.mode=loo"])
    keys = [["c", "answer", "d", "answer"], ["c", "answer", "e", "answer"], ["x", "answer", "d", "answer"]]
    passed = [[True, True], [True, False], [False, False]]  # the third failed its first user turn

    def group(with_verdicts: bool):
        out = _group([1.0, 0.0, 0.0], keys)
        for t, p in zip(out, passed):
            t.correct = all(p)
            t.user_turn_ends = [1, 3]
            t.user_turn_passed = list(p) if with_verdicts else []
        return out

    judged, _ = assign_advantages(group(True), replace(cfg.advantage, credit="turn"), reward_cfg=cfg.reward)
    whole, _ = assign_advantages(group(False), replace(cfg.advantage, credit="turn"), reward_cfg=cfg.reward)
    # after its failed first user turn nothing the third rollout does can earn the reward
    assert judged[2].turn_advantages[2:] == [0.0, 0.0]
    assert whole[2].turn_advantages[2] != 0.0  # without the verdicts its peers' successes count against it
    # turns before any user turn ended: both give the episode's baseline
    assert [t.turn_advantages[0] for t in judged] == [t.turn_advantages[0] for t in whole]
    # the first rollout's second user turn: baselined on its peer that made the same first-turn calls
    assert judged[0].turn_advantages[2] == pytest.approx(1.0 - 0.0)
