r"""Token logprobs and entropy from vocab-parallel logits, without gathering the vocabulary.

Shapes: T tokens, V_r = this tensor-parallel rank's slice of the (padded) vocabulary; rank r
holds the logits of vocabulary rows [r V_r, (r+1) V_r). With z = logits / temperature:

    m_t    = max_v z_tv                              (all-reduce MAX over TP)
    S_t    = sum_v exp(z_tv - m_t)                   (all-reduce SUM)
    logZ_t = m_t + log S_t
    logp_t = z_t,y_t - logZ_t                        (the target's logit comes from the rank owning y_t)
    H_t    = logZ_t - sum_v p_tv z_tv                (sum_v exp(z_tv - m_t) z_tv: all-reduce SUM, / S_t)

d logp_t / d z_tv = 1[v = y_t] - p_tv, recomputed in backward from the saved logits, so the
fp32 temporaries never exceed one chunk of ``chunk_tokens`` x V_r (a 16k-token microbatch of
Qwen3's 151k vocabulary is ~10 GB as full fp32 logits). The entropy is a metric: no gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 26  # fp32 temporaries per chunk: 256 MB


def _tp_group():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None, 0
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunks(T: int, V: int):
    step = max(1, CHUNK_ELEMENTS // max(V, 1))
    for s in range(0, T, step):
        yield s, min(T, s + step)


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, target_T, temperature):
        group, rank = _tp_group()
        T, V = logits_TV.shape
        lo = rank * V
        logz_T = torch.empty(T, dtype=torch.float32, device=logits_TV.device)
        lp_T = torch.empty_like(logz_T)
        ent_T = torch.empty_like(logz_T)
        for s, e in _chunks(T, V):
            z = logits_TV[s:e].float() / temperature
            m = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
            ez = torch.exp(z - m[:, None])
            sums = _all_reduce(torch.stack([ez.sum(-1), (ez * z).sum(-1)]), group)  # [S_t, sum exp * z]
            local = target_T[s:e] - lo
            owned = (local >= 0) & (local < V)
            tgt = torch.where(owned, z.gather(-1, local.clamp(0, V - 1)[:, None])[:, 0], torch.zeros_like(m))
            tgt = _all_reduce(tgt, group)
            logz = m + torch.log(sums[0])
            logz_T[s:e], lp_T[s:e], ent_T[s:e] = logz, tgt - logz, logz - sums[1] / sums[0]
        ctx.save_for_backward(logits_TV, target_T, logz_T)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent_T)
        return lp_T, ent_T

    @staticmethod
    def backward(ctx, grad_lp_T, grad_ent_T):
        logits_TV, target_T, logz_T = ctx.saved_tensors
        _, rank = _tp_group()
        T, V = logits_TV.shape
        lo = rank * V
        grad = torch.empty_like(logits_TV)
        for s, e in _chunks(T, V):
            p = torch.exp(logits_TV[s:e].float() / ctx.temperature - logz_T[s:e, None])
            g = -p
            local = target_T[s:e] - lo
            owned = (local >= 0) & (local < V)
            rows = torch.nonzero(owned)[:, 0]
            g[rows, local[rows]] += 1.0
            grad[s:e] = (g * (grad_lp_T[s:e, None] / ctx.temperature)).to(grad.dtype)
        return grad, None, None


def logprobs_and_entropy(logits_TV: torch.Tensor, target_T: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per token from this rank's vocabulary slice; both fp32 [T]."""
    assert logits_TV.dim() == 2 and target_T.shape == logits_TV.shape[:1], (logits_TV.shape, target_T.shape)
    return _VocabParallelLogprob.apply(logits_TV, target_T, float(temperature))
