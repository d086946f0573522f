"""Token logprobs and entropy from (vocab-parallel) logits equal log_softmax's, with their gradient,
over several chunks, at a temperature, from fp32 and bf16 logits."""

import pytest
import torch

from nemo_orchestra.megatron import vocab_parallel
from nemo_orchestra.megatron.vocab_parallel import logprobs_and_entropy


def reference(logits_TV, target_T, temperature):
    logp_TV = torch.log_softmax(logits_TV.float() / temperature, dim=-1)
    lp_T = logp_TV.gather(-1, target_T[:, None])[:, 0]
    ent_T = -(logp_TV.exp() * logp_TV).sum(-1)
    return lp_T, ent_T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_log_softmax_with_gradient(monkeypatch, dtype, temperature):
    monkeypatch.setitem(vocab_parallel.CHUNK_ELEMENTS, "cpu", 7 * 50)  # 7 tokens a chunk: several chunks, one short
    g = torch.Generator().manual_seed(0)
    T, V = 40, 50
    logits = (3 * torch.randn(T, V, generator=g)).to(dtype)
    target = torch.randint(0, V, (T,), generator=g)
    weights = torch.randn(T, generator=g)

    x = logits.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(x, target, temperature)
    (lp * weights).sum().backward()
    y = logits.clone().requires_grad_(True)
    lp_ref, ent_ref = reference(y, target, temperature)
    (lp_ref * weights).sum().backward()

    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
    assert x.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x.grad.float(), y.grad.float(), atol=tol, rtol=tol)
    assert not torch.equal(logits, torch.zeros_like(logits)) and torch.equal(x.detach(), logits)  # input untouched


def test_without_entropy_same_logprobs():
    g = torch.Generator().manual_seed(1)
    logits, target = torch.randn(9, 13, generator=g), torch.randint(0, 13, (9,), generator=g)
    lp, _ = logprobs_and_entropy(logits, target, 0.5)
    lp2, ent2 = logprobs_and_entropy(logits, target, 0.5, with_entropy=False)
    assert torch.equal(lp, lp2) and torch.count_nonzero(ent2) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_set_of_tokens_probability_equals_log_softmax_with_gradient(dtype, temperature):
    """``set_logprobs``: log of the summed softmax over each row's set (padded with -1), and its gradient, as
    ``logsumexp`` over the set minus over the vocabulary computes them."""
    from nemo_orchestra.megatron.vocab_parallel import set_logprobs

    g = torch.Generator().manual_seed(1)
    P, V = 6, 50
    logits = (3 * torch.randn(P, V, generator=g)).to(dtype)
    sets = [[3, 7, 9], [0], [49, 1, 2, 5], [10, 11], [4], [30, 31, 32, 33]]
    ids = torch.tensor([s + [-1] * (4 - len(s)) for s in sets])
    weights = torch.randn(P, generator=g)

    x = logits.clone().requires_grad_(True)
    lp = set_logprobs(x, ids, temperature)
    (lp * weights).sum().backward()
    y = logits.clone().requires_grad_(True)
    z = y.float() / temperature
    ref = torch.stack([torch.logsumexp(z[p, s], -1) for p, s in enumerate(sets)]) - torch.logsumexp(z, -1)
    (ref * weights).sum().backward()

    assert lp.dtype == torch.float32 and x.grad.dtype == dtype
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x.grad.float(), y.grad.float(), atol=tol, rtol=tol)
