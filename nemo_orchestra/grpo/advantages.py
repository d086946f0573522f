"""Group-relative advantages and dynamic sampling (drop groups with nothing to learn)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

import kernels
from nemo_orchestra.config import AdvantageConfig
from nemo_orchestra.types import StopReason, Trajectory

STD_TOLERANCE = 1e-8  # a group's reward std must exceed min_group_std by this to count as informative


def assign_advantages(
    trajectories: Sequence[Trajectory], cfg: AdvantageConfig, device: torch.device | str = "cpu"
) -> tuple[list[Trajectory], dict]:
    """Set ``advantage`` (A_i = clip((R_i - mean)/(std + eps), -c, c) for mode std) on every rollout.

    Rewards and advantages live on ``device``, the training device: on a GPU the Triton kernel
    (``kernels.grouped_advantage``) computes them, on CPU its PyTorch reference (or the kernel under
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
    # the filter reads the rewards the host already holds (dynamic sampling asks the same question)
    keep_groups = informative_groups(trajectories, cfg.min_group_std)
    kept = [t for t in trajectories if t.group in keep_groups]
    # ToolOrchestra's rollout filters: such rollouts count in their group's statistics (as reward 0)
    # but are not trained on
    malformed = [t for t in kept if cfg.drop_format_errors and t.format_errors + t.schema_errors > 0]
    unanswered = [t for t in kept if cfg.drop_unanswered and t.stop_reason != StopReason.ANSWER]
    dropped = {id(t) for t in malformed + unanswered}
    return [t for t in kept if id(t) not in dropped], {
        "advantage/groups_kept": len(keep_groups),
        "advantage/groups_dropped": len({t.group for t in trajectories}) - len(keep_groups),
        "advantage/abs_mean": float(adv.abs().mean()),
        "advantage/dropped_format_errors": len(malformed),
        "advantage/dropped_unanswered": len(unanswered),
    }


def informative_groups(trajectories: Sequence[Trajectory], min_group_std: float) -> set[int]:
    """The groups ``assign_advantages`` keeps: reward sample std (Bessel's, as the kernel's) above
    ``min_group_std``."""
    rewards: dict[int, list[float]] = {}
    for t in trajectories:
        rewards.setdefault(t.group, []).append(t.reward)
    return {g for g, r in rewards.items() if len(r) > 1 and statistics.stdev(r) > min_group_std + STD_TOLERANCE}
