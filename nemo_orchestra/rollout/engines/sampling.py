"""Sampling whose draws belong to the sequence, not to the batch.

With one generator for a whole batch, a sequence's draw depends on which other sequences share its
batch and in what order: in the agent loop, on which episodes' tool calls came back first. Given a
seed per sequence (``GenerationEngine.generate(..., seeds=...)``), the in-process engines keep one
generator per sequence and sample by the exponential race: token ``argmax_v p_v / q_v`` with
``q_v ~ Exp(1)`` drawn from the sequence's own generator, which picks ``v`` with probability
``p_v`` (the Gumbel-max trick in another form; vLLM samples so as well). A sequence's tokens then
depend on its seed, its prompt and the weights only: a turn is the same alone or in any batch, and
an interrupted step regenerates the rollouts it lost as they were.
"""

from __future__ import annotations

import torch

_TINY = torch.finfo(torch.float32).tiny


def row_generators(seeds: list[int], device: torch.device) -> list[torch.Generator]:
    """One generator per sequence, on the device where its noise is drawn."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def sample_rows(probs_NV: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs_NV`` (rows sum to 1, zeros never drawn), row ``i`` drawing its
    noise from ``generators[i]`` alone: one row of exponentials per call."""
    if len(generators) != probs_NV.shape[0]:
        raise ValueError(f"sample_rows: {probs_NV.shape[0]} rows but {len(generators)} generators")
    q_NV = torch.empty(probs_NV.shape, dtype=torch.float32, device=probs_NV.device)
    for i, g in enumerate(generators):
        q_NV[i].exponential_(generator=g)
    return torch.div(probs_NV.float(), q_NV.clamp_(min=_TINY), out=q_NV).argmax(dim=-1)  # p / q into q's buffer
