"""The variance of a step's policy-gradient estimate, under each credit (``advantage.grad_variance_every``).

A GRPO step estimates the policy gradient from m groups, one per prompt, drawn independently:

    g = (1/N) sum_tokens A_t grad log pi(a_t)   =   (1/m) sum_k c_k,   c_k = (1/Nbar) sum_{t in group k} A_t grad log pi(a_t)

with N the step's trained tokens and Nbar = N/m. The c_k are i.i.d. with mean E[g], so
``tr Var(g) = tr Var(c)/m``, estimated without bias by ``sum_k |c_k - g|^2 / (m (m - 1))``. This is the
variance the credit decides: the same rollouts, the same score functions, only A_t differs. Both
credits are measured on the step's rollouts before its update, at the policy that sampled them
(ratio 1, so c_k is the gradient of the clipped objective's policy-gradient term; the KL term does not
depend on the credit and is left out).

Reported per measured step (``grad/`` in the metrics): for each credit ``pg_variance_<credit>``
(tr Var(g)), ``pg_sq_norm_<credit>`` (|g|^2) and ``pg_signal_<credit>`` = |g|^2 - tr Var(g), the
unbiased estimate of |E g|^2 (|g|^2 alone is mostly noise when the variance dominates). It costs a
forward and a backward pass of every trained token per credit, on a second copy of the gradient: a
diagnostic for every few steps, not every step.

Needs ``parallel.pp=1`` (the per-group gradients come from ``torch.autograd.grad`` on this rank's
whole model, outside the pipeline schedule; config checks it). Tensor-parallel shards sum their
squares over the model-parallel group, each replicated parameter counted once; data-parallel ranks
measure their own groups and the sums are all-reduced.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from nemo_orchestra.config import AdvantageConfig, ParallelConfig, RewardConfig
from nemo_orchestra.grpo.advantages import assign_turn_advantages
from nemo_orchestra.megatron.forward import loss_rows, pack_logprobs, packed_forward
from nemo_orchestra.train.packing import pack
from nemo_orchestra.types import Trajectory


def credit_views(
    trajectories: Sequence[Trajectory],
    adv_cfg: AdvantageConfig,
    reward_cfg: RewardConfig | None,
    peers: Sequence[Trajectory] | None = None,
) -> dict[str, list[Trajectory]]:
    """The trained rollouts under each credit: shallow copies whose ``token_advantages`` are the episode's
    and the per-turn ones. When the run trains on the episode's, the per-turn ones are computed here on
    ``peers`` (the step's rollouts, filtered ones included, as training would baseline them; default: the
    trained ones)."""
    episode = [copy.copy(t) for t in trajectories]
    for t in episode:
        t.turn_advantages = None
    if adv_cfg.credit == "turn":
        return {"episode": episode, "turn": [copy.copy(t) for t in trajectories]}
    everyone = {id(t): copy.copy(t) for t in (peers if peers is not None else trajectories)}
    for t in everyone.values():
        t.turn_advantages = None
    assign_turn_advantages(list(everyone.values()), adv_cfg, reward_cfg)
    # a malformed rollout's calls (``malformed_call_rollouts``, not among the peers) train the same under both
    return {"episode": episode, "turn": [everyone.get(id(t), t) for t in trajectories]}


def policy_gradient_variance(
    learner,
    trajectories: Sequence[Trajectory],
    adv_cfg: AdvantageConfig,
    reward_cfg: RewardConfig | None,
    parallel: ParallelConfig,
    share_prompts: bool = False,
    temperature: float = 1.0,
    peers: Sequence[Trajectory] | None = None,
) -> dict[str, float]:
    """``grad/pg_variance_<credit>``, ``grad/pg_sq_norm_<credit>`` and ``grad/pg_signal_<credit>`` for both
    credits on this step's trained rollouts (module docstring); ``peers``: see ``credit_views``.
    Collective over the model- and data-parallel groups; leaves the model's gradient buffers as they were."""
    params = [p for p in learner.module.parameters() if p.requires_grad]
    out: dict[str, float] = {}
    for credit, trajs in credit_views(trajectories, adv_cfg, reward_cfg, peers).items():
        stats = group_gradient_stats(learner, params, trajs, parallel, share_prompts, temperature)
        out.update({f"grad/{k}_{credit}": v for k, v in stats.items()})
    return out


def group_gradient_stats(
    learner, params: list[torch.Tensor], trajs: Sequence[Trajectory], parallel, share_prompts: bool, temperature: float
) -> dict[str, float]:
    """tr Var(g), |g|^2 and their difference for ``trajs`` as they are (their ``token_advantages``)."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group, []).append(t)
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]  # sum_k u_k, u_k = Nbar * c_k
    sq_sum, tokens = 0.0, 0.0  # sum_k |u_k|^2 on this rank's shards; trained tokens
    for group in groups.values():
        surrogate, n = None, 0.0
        for batch in pack(group, parallel.microbatch_tokens, pad_to_multiple=parallel.tp, share_prompts=share_prompts):
            rows = loss_rows(batch, learner.device)
            if not rows.numel():
                continue
            logits = packed_forward(learner.model, batch, learner.device, rows)
            lp_T, _ = pack_logprobs(logits, batch, rows, temperature, with_entropy=False)
            mask = batch.loss_mask_T.to(lp_T.device)
            term = (batch.advantages_T.to(lp_T.device) * mask * lp_T).sum()
            surrogate = term if surrogate is None else surrogate + term
            n += float(mask.sum())
        if surrogate is None:
            continue
        grads = torch.autograd.grad(surrogate, params, allow_unused=True)
        for acc, g in zip(total, grads):
            if g is not None:
                acc.add_(g.float())
        sq_sum += _local_sq_norm(params, grads)
        tokens += n
    counts = torch.tensor([sq_sum, tokens, float(len(groups))], dtype=torch.float64)
    _all_reduce_data_parallel(total, counts)
    sq_sum = _sum_model_parallel(counts[0].item())  # shards of one u_k add up across the model-parallel group
    tokens, m = counts[1].item(), counts[2].item()
    mean_sq = _sum_model_parallel(_local_sq_norm(params, total))  # |sum_k u_k|^2
    if m < 2 or tokens <= 0:
        return {"pg_variance": math.nan, "pg_sq_norm": math.nan, "pg_signal": math.nan}
    nbar = tokens / m
    g_sq = mean_sq / tokens**2  # |g|^2, g = sum_k u_k / N
    spread = max(sq_sum / nbar**2 - m * g_sq, 0.0)  # sum_k |c_k - g|^2 = sum_k |c_k|^2 - m |g|^2
    variance = spread / (m * (m - 1))
    return {"pg_variance": variance, "pg_sq_norm": g_sq, "pg_signal": g_sq - variance}


def _local_sq_norm(params: list[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> float:
    """Squared norm of this rank's gradient shards, a tensor-parallel replica counted on one rank only."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    first_tp = not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_rank() == 0
    total = 0.0
    for p, g in zip(params, grads):
        if g is None or not (first_tp or param_is_not_tensor_parallel_duplicate(p)):
            continue
        total += float(g.float().pow(2).sum())
    return total


def _sum_model_parallel(value: float) -> float:
    """``value`` summed over the tensor-parallel group (with pp=1, the whole model-parallel group)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return value
    from nemo_orchestra.megatron.parallel import comm_device

    t = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())  # pp=1: the model-parallel group
    return t.item()


def _all_reduce_data_parallel(vectors: list[torch.Tensor], counts: torch.Tensor) -> None:
    """Sum ``vectors`` and ``counts`` (in place) over the data-parallel group."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_data_parallel_world_size() == 1:
        return
    from nemo_orchestra.megatron.parallel import comm_device

    group = ps.get_data_parallel_group()
    dev = comm_device()
    for v in vectors:
        moved = v.to(dev)
        dist.all_reduce(moved, group=group)
        v.copy_(moved)
    moved = counts.to(dev)
    dist.all_reduce(moved, group=group)
    counts.copy_(moved)
