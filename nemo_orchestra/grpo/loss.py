r"""Token-level clipped policy loss with dual clip and a k3 KL penalty to a frozen reference.

Per generated token t of a rollout with advantage A:

    r_t    = exp(logp_t - old_logp_t)
    pg_t   = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))
    pg_t   = min(pg_t, -A c)                 if A < 0   (dual clip, c = loss.dual_clip)
    pg_t   = w_t pg_t,  w_t = min(exp(old_logp_t - gen_logp_t), C)   if C = loss.tis_cap is set
    kl_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1  (k3: unbiased, >= 0)
    loss   = sum_t mask_t (pg_t + beta kl_t) / N

w_t is truncated importance sampling: the rollout was sampled by the generation engine (gen_logp,
e.g. vLLM's kernels), not by the trainer's own forward (old_logp); weighting by their ratio,
capped at C and without gradient, corrects that mismatch at bounded variance.

N is the number of generated tokens in the whole step across every microbatch and data-parallel
rank, so splitting the step into microbatches or ranks does not change the gradient. This
function returns the microbatch's *sum* and its token count; Megatron-Core's
``finalize_model_grads`` all-reduces the counts and scales the summed gradients by 1/N
(``calculate_per_token_loss=True``).
"""

from __future__ import annotations

import torch

from nemo_orchestra.config import LossConfig


def policy_loss(
    logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    ref_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    mask_T: torch.Tensor,
    cfg: LossConfig,
    is_weights_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Returns (sum of per-token losses, number of loss tokens, metrics).

    ``is_weights_T``: per-token importance weights on the policy-gradient term (see ``tis_weights``).
    """
    mask = mask_T.float()
    log_ratio = (logprobs_T - old_logprobs_T).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages_T * ratio
    pg2 = -advantages_T * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(pg1, pg2)
    if cfg.dual_clip is not None:
        pg = torch.where(advantages_T < 0, torch.minimum(pg, -advantages_T * cfg.dual_clip), pg)
    if is_weights_T is not None:
        pg = pg * is_weights_T.detach()
    if cfg.kl_coef > 0:
        delta = (ref_logprobs_T - logprobs_T).clamp(-20.0, 20.0)
        kl = torch.exp(delta) - delta - 1.0
        loss_sum = ((pg + cfg.kl_coef * kl) * mask).sum()
    else:  # no KL term: the trainer runs no reference forward, ref_logprobs_T is not filled
        kl = torch.zeros_like(pg)
        loss_sum = (pg * mask).sum()
    with torch.no_grad():
        n = mask.sum().clamp_min(1.0)
        metrics = {
            "loss/pg": (pg * mask).sum() / n,
            "loss/kl": (kl * mask).sum() / n,
            "loss/clip_frac": ((pg2 > pg1).float() * mask).sum() / n,
            "loss/ratio_mean": (ratio * mask).sum() / n,
            "loss/tokens": mask.sum(),
        }
        if is_weights_T is not None:
            metrics["loss/tis_weight_mean"] = (is_weights_T * mask).sum() / n
    return loss_sum, mask.sum(), metrics


def tis_weights(old_logprobs_T: torch.Tensor, gen_logprobs_T: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights min(exp(old - gen), cap): trainer over generator probability."""
    return torch.exp((old_logprobs_T - gen_logprobs_T).clamp(-20.0, 20.0)).clamp(max=cap)
