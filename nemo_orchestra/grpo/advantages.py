"""Group-relative advantages, per episode or per turn, and dynamic sampling (drop groups with nothing
to learn).

Per-turn credit (``advantage.credit=turn``; the derivation is in docs/credit_assignment.md): turn t of
rollout i gets A_it = lam * (R_i - b_it) / s, where b_it is the mean reward of the OTHER rollouts of the
group that took the same actions before turn t (each ``TurnRecord.key`` of ``Trajectory.turns``), or, when none did, of those
that share the longest shorter prefix (at turn 1: all the others). The baseline never reads rollout i's
own reward or its actions from turn t on, so the estimator stays unbiased whatever the rollouts' numbers
of turns. s and lam are the episode credit's (s: the group's reward std for ``mode=std``, else 1; lam =
(n-1)/n, 1 for ``mode=loo``), so a turn whose baseline is every other rollout gets exactly the episode
credit's advantage: single-turn groups train identically under both.

Where the task judges each user turn (BFCL: ``Trajectory.user_turn_passed``), a spliced rollout's outcome
takes rollout i's verdicts on the user turns it ended before turn t and the peer's on the rest: after a
failed user turn, nothing later can earn the reward, and the later turns' advantage is 0.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import statistics
from collections.abc import Callable, Sequence

import torch

from nemo_orchestra import kernels
from nemo_orchestra.config import AdvantageConfig, RewardConfig
from nemo_orchestra.grpo.reward import group_value, latency_at_resolution
from nemo_orchestra.types import StopReason, Trajectory

STD_TOLERANCE = 1e-8  # a group's reward std must exceed min_group_std by this to count as informative


def assign_advantages(
    trajectories: Sequence[Trajectory],
    cfg: AdvantageConfig,
    device: torch.device | str = "cpu",
    reward_cfg: RewardConfig | None = None,
) -> tuple[list[Trajectory], dict]:
    """Set ``advantage`` (A_i = clip((R_i - mean)/(std + eps), -c, c) for mode std) on every rollout.

    Rewards and advantages live on ``device``, the training device: on a GPU the Triton kernel
    (``nemo_orchestra.kernels.grouped_advantage``) computes them, on CPU its PyTorch reference (or the kernel under
    ``TRITON_INTERPRET=1``). Returns the rollouts of groups whose reward std exceeds
    ``cfg.min_group_std`` (a group whose rewards are all equal has zero advantage everywhere: it
    costs compute and teaches nothing), and metrics.
    """
    if not trajectories:
        return [], {"advantage/groups_kept": 0, "advantage/groups_dropped": 0}
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32, device=device)
    group_ids = torch.tensor([t.group for t in trajectories], dtype=torch.int64, device=device)
    adv = kernels.grouped_advantage(rewards, group_ids=group_ids, mode=cfg.mode, eps=cfg.eps, clip=cfg.clip)
    for t, a in zip(trajectories, adv.tolist()):  # one device-to-host copy
        t.advantage = a
    turn_metrics = assign_turn_advantages(trajectories, cfg, reward_cfg) if cfg.credit == "turn" else {}
    # the filter reads the rewards the host already holds (dynamic sampling asks the same question)
    keep_groups = informative_groups(trajectories, cfg.min_group_std)
    kept = [t for t in trajectories if t.group in keep_groups]
    # ToolOrchestra's rollout filters: such rollouts count in their group's statistics (as reward 0)
    # but are not trained on
    malformed = [t for t in kept if cfg.drop_format_errors and t.format_errors + t.schema_errors > 0]
    unanswered = [t for t in kept if cfg.drop_unanswered and t.stop_reason != StopReason.ANSWER]
    dropped = {id(t) for t in malformed + unanswered}
    calls = malformed_call_rollouts(malformed, trajectories, cfg) if cfg.train_malformed_calls else {}
    trained = [calls.get(id(t), t) for t in kept if id(t) not in dropped or id(t) in calls]
    return trained, {
        "advantage/groups_kept": len(keep_groups),
        "advantage/groups_dropped": len({t.group for t in trajectories}) - len(keep_groups),
        "advantage/abs_mean": float(adv.abs().mean()),
        "advantage/dropped_format_errors": len(malformed),
        "advantage/dropped_unanswered": len(unanswered),
        "advantage/malformed_calls_trained": len(calls),
        **turn_metrics,
    }


def failure_advantage(rewards: Sequence[float], mode: str, eps: float, clip: float | None) -> float:
    """The advantage a failed rollout (reward 0: an incorrect rollout earns 0) gets at a group's mean and scale, as
    ``kernels.grouped_advantage`` computes a member's (``mode`` std, mean or loo; then clipped)."""
    n = len(rewards)
    if n < 2:
        return 0.0
    dev = -statistics.fmean(rewards)
    a = dev * n / (n - 1) if mode == "loo" else dev if mode == "mean" else dev / (statistics.stdev(rewards) + eps)
    return max(-clip, min(clip, a)) if clip else a


def malformed_call_rollouts(
    malformed: Sequence[Trajectory], trajectories: Sequence[Trajectory], cfg: AdvantageConfig
) -> dict[int, Trajectory]:
    """``advantage.train_malformed_calls``: for each malformed rollout (by ``id``), a copy that trains only its
    malformed turns' ``TurnRecord.broken`` spans (the token where each broke, else its call; the plans, the other
    turns and the outcome they reached stay out of the loss), each with the advantage a failure gets in its group
    (``failure_advantage``): a call that does not parse or fit the tools counts as a failed episode, whatever the
    episode did after it. Rollouts without spans (message-based policies), and groups where a failure is not
    below the mean, give none."""
    rewards: dict[int, list[float]] = {}
    for t in trajectories:
        rewards.setdefault(t.group, []).append(t.reward)
    out = {}
    for t in malformed:
        a = failure_advantage(rewards[t.group], cfg.mode, cfg.eps, cfg.clip)
        spans = [r.broken for r in t.turns if r.broken is not None]
        if a >= 0 or not spans:
            continue
        mask = [0] * len(t.loss_mask)
        for start, end in spans:
            mask[start:end] = t.loss_mask[start:end]
        out[id(t)] = dataclasses.replace(t, loss_mask=mask, advantage=a, turn_advantages=None)
    return out


def turn_advantages(
    rewards: Sequence[float],
    keys: Sequence[Sequence[str]],
    mode: str,
    eps: float,
    counterfactual: Callable[[int, int, int], float] | None = None,
) -> list[list[float]]:
    """Per-turn advantages of one group (module docstring): ``keys[i]`` the actions of rollout i's turns,
    one advantage per key (unclipped). ``counterfactual(i, j, t)``: the reward of rollout i's turns before
    t followed by rollout j's from t on (its outcome, its costs and latencies); None: ``rewards[j]``."""
    n = len(rewards)
    if n < 2:
        return [[0.0] * len(k) for k in keys]
    scale = (statistics.stdev(rewards) + eps) if mode == "std" else 1.0
    lam = 1.0 if mode == "loo" else (n - 1) / n
    future = counterfactual or (lambda i, j, t: rewards[j])
    out = []
    for i, own in enumerate(keys):
        peers = [j for j in range(n) if j != i]  # the rollouts that took i's actions before this turn
        advs = []
        for t in range(len(own)):
            if t > 0:
                same = [j for j in peers if len(keys[j]) > t - 1 and keys[j][t - 1] == own[t - 1]]
                if same:
                    peers = same
            baseline = statistics.fmean(future(i, j, t) if t else rewards[j] for j in peers)
            advs.append(lam * (rewards[i] - baseline) / scale)
        out.append(advs)
    return out


def assign_turn_advantages(
    trajectories: Sequence[Trajectory], cfg: AdvantageConfig, reward_cfg: RewardConfig | None = None
) -> dict[str, float]:
    """``turn_advantages`` on every rollout with turns (clipped as the episode's), group by group;
    rollouts without (warm-start lessons, message-based policies) keep the episode's. With
    ``reward_cfg`` a peer's future is transplanted after the rollout's own past (``group_value``): the
    costs and latency already paid count in the baseline as in the reward. Metrics: the per-turn
    advantages' size and spread within an episode, and for both credits the advantage's second moment
    per trained token: the factor of the policy-gradient estimate's variance that the credit sets (the
    other, the score's norm, is the same for both)."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group, []).append(t)
    for group in groups.values():
        if not all(_has_turn_records(t) for t in group):
            continue
        rewards = [t.reward for t in group]
        per_turn = turn_advantages(
            rewards, [[r.key for r in t.turns] for t in group], cfg.mode, cfg.eps, _counterfactual(group, reward_cfg)
        )
        for t, advs in zip(group, per_turn):
            t.turn_advantages = [max(-cfg.clip, min(cfg.clip, a)) if cfg.clip else a for a in advs]
    return turn_metrics(trajectories)


def _has_turn_records(t: Trajectory) -> bool:
    """Each turn's action and first generated id are recorded (not a lesson's, nor a policy's on messages)."""
    return bool(t.turns) and all(r.key and r.start is not None for r in t.turns)


def _counterfactual(group: Sequence[Trajectory], reward_cfg: RewardConfig | None):
    """``counterfactual(i, j, t)`` for ``turn_advantages`` from the rollouts' per-turn costs and calls; None
    when the reward cannot be evaluated on a spliced rollout (``group_value``)."""
    value = group_value(group, reward_cfg) if reward_cfg is not None else None
    if value is None:
        return None
    res = reward_cfg.latency_resolution_s
    costs = [list(itertools.accumulate((r.cost for r in t.turns), initial=0.0)) for t in group]  # cumulative
    calls = [list(itertools.accumulate((r.calls for r in t.turns), initial=0)) for t in group]

    def latency(k: int, start: int, end: int) -> float:
        return latency_at_resolution(group[k].call_latencies_s[calls[k][start] : calls[k][end]], res)

    per_user_turn = all(t.user_turn_passed for t in group)

    def correct(i: int, j: int, t: int) -> bool:
        """The spliced rollout's outcome: j's, or where the task judges each user turn, i's verdicts on the
        user turns i ended before turn t and j's on the rest."""
        if not per_user_turn:
            return group[j].correct
        done = bisect.bisect_left(group[i].user_turn_ends, t)  # user turns i ended before turn t (ends ascend)
        return all(group[i].user_turn_passed[:done]) and all(group[j].user_turn_passed[done:])

    def counterfactual(i: int, j: int, t: int) -> float:
        tj = len(group[j].turns)
        t_j = min(t, tj)
        cost = costs[i][t] + costs[j][tj] - costs[j][t_j]
        lat = latency(i, 0, t) + latency(j, t_j, tj)
        return value(correct(i, j, t), cost, lat)

    return counterfactual


def turn_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    turned = [t for t in trajectories if t.turn_advantages]
    # the share per-turn credit reached: a group with a rollout without per-turn records keeps the episode's
    share = {"advantage/turn_credited_share": len(turned) / max(len(trajectories), 1)}
    if not turned:
        return share
    flat = [a for t in turned for a in t.turn_advantages]
    spread = [statistics.pstdev(t.turn_advantages) for t in turned if len(t.turn_advantages) > 1]
    episode_sq = turn_sq = tokens = 0.0
    for t in turned:
        for a, n in zip(t.turn_advantages, _turn_tokens(t)):
            episode_sq, turn_sq, tokens = episode_sq + n * t.advantage**2, turn_sq + n * a * a, tokens + n
    return {
        **share,
        "advantage/turn_abs_mean": statistics.fmean(abs(a) for a in flat),
        "advantage/turn_spread_in_episode": statistics.fmean(spread) if spread else 0.0,
        "advantage/turn_second_moment": turn_sq / max(tokens, 1.0),
        "advantage/episode_second_moment": episode_sq / max(tokens, 1.0),
    }


def _turn_tokens(t: Trajectory) -> list[int]:
    """Trained tokens of each turn."""
    bounds = [*(r.start for r in t.turns), len(t.token_ids)]
    return [sum(t.loss_mask[s:e]) for s, e in zip(bounds, bounds[1:])]


def informative_groups(trajectories: Sequence[Trajectory], min_group_std: float) -> set[int]:
    """The groups ``assign_advantages`` keeps: reward sample std (Bessel's, as the kernel's) above
    ``min_group_std``."""
    rewards: dict[int, list[float]] = {}
    for t in trajectories:
        rewards.setdefault(t.group, []).append(t.reward)
    return {g for g, r in rewards.items() if len(r) > 1 and statistics.stdev(r) > min_group_std + STD_TOLERANCE}
