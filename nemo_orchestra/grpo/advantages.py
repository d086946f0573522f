"""Group-relative advantages and dynamic sampling (drop groups with nothing to learn)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

import kernels
from nemo_orchestra.config import AdvantageConfig
from nemo_orchestra.types import Trajectory


def assign_advantages(trajectories: Sequence[Trajectory], cfg: AdvantageConfig) -> tuple[list[Trajectory], dict]:
    """Set ``advantage`` (A_i = clip((R_i - mean)/(std + eps), -c, c) for mode std) on every rollout.

    Returns the rollouts of groups whose reward std exceeds ``cfg.min_group_std`` (a group whose
    rewards are all equal has zero advantage everywhere: it costs compute and teaches nothing),
    and metrics.
    """
    if not trajectories:
        return [], {"advantage/groups_kept": 0, "advantage/groups_dropped": 0}
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    group_ids = torch.tensor([t.group for t in trajectories], dtype=torch.int64)
    adv = kernels.grouped_advantage(rewards, group_ids=group_ids, mode=cfg.mode, eps=cfg.eps, clip=cfg.clip)
    for t, a in zip(trajectories, adv.tolist()):
        t.advantage = a
    keep_groups, dropped = set(), 0
    for g in group_ids.unique().tolist():
        r = rewards[group_ids == g]
        std = r.std(unbiased=True).item() if r.numel() > 1 else 0.0
        if std > cfg.min_group_std + 1e-8:
            keep_groups.add(g)
        else:
            dropped += 1
    kept = [t for t in trajectories if t.group in keep_groups]
    return kept, {
        "advantage/groups_kept": len(keep_groups),
        "advantage/groups_dropped": dropped,
        "advantage/abs_mean": float(adv.abs().mean()),
    }
