r"""Token logprobs and entropy from vocab-parallel logits, without gathering the vocabulary.

Shapes: T tokens, V_r = this tensor-parallel rank's slice of the (padded) vocabulary; rank r
holds the logits of vocabulary rows [r V_r, (r+1) V_r). With z = logits / temperature:

    m_t    = max_v z_tv                              (all-reduce MAX over TP)
    S_t    = sum_v exp(z_tv - m_t)                   (all-reduce SUM)
    logZ_t = m_t + log S_t
    logp_t = z_t,y_t - logZ_t                        (the target's logit comes from the rank owning y_t)
    H_t    = logZ_t - sum_v p_tv z_tv                (sum_v exp(z_tv - m_t) z_tv: all-reduce SUM, / S_t)

d logp_t / d z_tv = 1[v = y_t] - p_tv, recomputed in backward from the saved logits, so the
fp32 temporaries never exceed one chunk of tokens x V_r (a 16k-token microbatch of
Qwen3's 151k vocabulary is ~10 GB as full fp32 logits). The entropy is a metric: no gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# fp32 elements per chunk of temporaries. On a GPU, large chunks keep kernels busy (256 MB); on a CPU,
# 2 MB chunks stay in cache across the chain of elementwise passes, where a chunk larger than the cache
# goes to memory and back once per pass (docs/performance.md).
CHUNK_ELEMENTS = {"cuda": 1 << 26, "cpu": 1 << 19}


def _tp_group():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None, 0
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunks(T: int, V: int, device: torch.device):
    step = max(1, CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["cuda"]) // max(V, 1))
    for s in range(0, T, step):
        yield s, min(T, s + step)


def _scaled(logits_CV: torch.Tensor, temperature: float, writable: bool = False) -> torch.Tensor:
    """z = logits / temperature in fp32; a new tensor when ``writable`` (the caller's logits are never
    written), else the logits themselves when they are fp32 already and the temperature is 1."""
    if temperature == 1.0:
        return logits_CV.to(torch.float32, copy=writable)
    return logits_CV.float() * (1.0 / temperature)


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, target_T, temperature, with_entropy):
        group, rank = _tp_group()
        T, V = logits_TV.shape
        lo = rank * V
        logz_T = torch.empty(T, dtype=torch.float32, device=logits_TV.device)
        lp_T = torch.empty_like(logz_T)
        ent_T = torch.empty_like(logz_T) if with_entropy else None
        for s, e in _chunks(T, V, logits_TV.device):
            z = _scaled(logits_TV[s:e], temperature)
            local = target_T[s:e] - lo
            owned = (local >= 0) & (local < V)
            tgt = torch.where(owned, z.gather(-1, local.clamp(0, V - 1)[:, None])[:, 0], 0.0)
            m = _all_reduce(z.amax(dim=-1), group, dist.ReduceOp.MAX)
            ez = z.sub(m[:, None]).exp_()
            if with_entropy:  # [S_t, sum_v exp(z_tv - m_t) z_tv]: a row-wise dot product, no temporary
                dots = torch.bmm(ez[:, None, :], z[:, :, None])[:, 0, 0]
                sums = _all_reduce(torch.stack([ez.sum(-1), dots]), group)
            else:
                sums = _all_reduce(ez.sum(-1)[None], group)
            tgt = _all_reduce(tgt, group)
            logz = m + torch.log(sums[0])
            logz_T[s:e], lp_T[s:e] = logz, tgt - logz
            if with_entropy:
                ent_T[s:e] = logz - sums[1] / sums[0]
        ctx.save_for_backward(logits_TV, target_T, logz_T)
        ctx.temperature = temperature
        if not with_entropy:
            ent_T = torch.zeros_like(logz_T)
        ctx.mark_non_differentiable(ent_T)
        return lp_T, ent_T

    @staticmethod
    def backward(ctx, grad_lp_T, grad_ent_T):
        logits_TV, target_T, logz_T = ctx.saved_tensors
        _, rank = _tp_group()
        T, V = logits_TV.shape
        lo = rank * V
        grad = torch.empty_like(logits_TV)
        g_T = grad_lp_T.float() / ctx.temperature
        for s, e in _chunks(T, V, logits_TV.device):
            # d logp_t / d logits_tv = (1[v = y_t] - p_tv) / temperature, scaled by the incoming gradient
            g = (
                _scaled(logits_TV[s:e], ctx.temperature, writable=True)
                .sub_(logz_T[s:e, None])
                .exp_()
                .mul_(-g_T[s:e, None])
            )
            local = target_T[s:e] - lo
            rows = torch.nonzero((local >= 0) & (local < V))[:, 0]
            g[rows, local[rows]] += g_T[s:e][rows]
            grad[s:e] = g
        return grad, None, None, None


def logprobs_and_entropy(
    logits_TV: torch.Tensor, target_T: torch.Tensor, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per token from this rank's vocabulary slice; both fp32 [T].
    ``with_entropy=False`` skips the entropy's pass (it is then zeros)."""
    assert logits_TV.dim() == 2 and target_T.shape == logits_TV.shape[:1], (logits_TV.shape, target_T.shape)
    return _VocabParallelLogprob.apply(logits_TV, target_T, float(temperature), with_entropy)


class _VocabParallelSetLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_PV, ids_PB, temperature):
        group, rank = _tp_group()
        V = logits_PV.shape[1]
        z = _scaled(logits_PV, temperature)
        local = ids_PB - rank * V
        owned = (ids_PB >= 0) & (local >= 0) & (local < V)
        m = _all_reduce(z.amax(dim=-1), group, dist.ReduceOp.MAX)
        ez = z.sub(m[:, None]).exp_()
        in_set = torch.where(owned, ez.gather(-1, local.clamp(0, V - 1)), 0.0).sum(-1)
        sums = _all_reduce(torch.stack([ez.sum(-1), in_set]), group)
        ctx.save_for_backward(logits_PV, local, owned, m, sums)
        ctx.temperature = temperature
        return torch.log(sums[1]) - torch.log(sums[0])

    @staticmethod
    def backward(ctx, grad_P):
        logits_PV, local, owned, m, sums = ctx.saved_tensors
        V = logits_PV.shape[1]
        g_P = grad_P.float() / ctx.temperature
        # d log P(S) / d z_v = p_v (1[v in S] / P(S) - 1), p_v = exp(z_v - m) / sum
        ez = _scaled(logits_PV, ctx.temperature, writable=True).sub_(m[:, None]).exp_()
        grad = ez * (-g_P / sums[0])[:, None]
        scale = torch.where(owned, (g_P / sums[1])[:, None], 0.0)
        picked = local.clamp(0, V - 1)
        grad.scatter_add_(-1, picked, scale * ez.gather(-1, picked))
        return grad.to(logits_PV.dtype), None, None


def set_logprobs(logits_PV: torch.Tensor, ids_PB: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log sum_{v in S_p} softmax(logits_p / temperature)_v per row p, the probability of a set of tokens
    S_p (``ids_PB``, vocabulary ids padded with -1; repeated ids count once each) from this rank's
    vocabulary slice; fp32 [P], differentiable. For a handful of rows: no chunking."""
    assert logits_PV.dim() == 2 and ids_PB.dim() == 2 and ids_PB.shape[0] == logits_PV.shape[0]
    return _VocabParallelSetLogprob.apply(logits_PV, ids_PB, float(temperature))
