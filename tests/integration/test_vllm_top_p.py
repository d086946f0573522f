"""vLLM's CPU top-p without its argsort (``rollout/engines/vllm_plugin.py: top_p_by_values_``): the same
nucleus as the sort-based mask vLLM defines, the kept mass never below p, and the plugin routes only
top-p-only CPU calls to it."""

import importlib.util

import pytest
import torch

from nemo_orchestra.rollout.engines import vllm_plugin
from nemo_orchestra.rollout.engines.vllm_plugin import TOP_P_ENV, register, top_p_by_values_

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
NEG = float("-inf")


def sorted_top_p(logits_BV: torch.Tensor, p_B: torch.Tensor) -> torch.Tensor:
    """The spec, as vLLM writes it: sort ascending, drop the prefix whose cumulative probability is
    <= 1 - p, never the last (most probable) token."""
    out = logits_BV.clone()
    srt, idx = out.sort(dim=-1)
    cum = srt.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - p_B).unsqueeze(1)
    drop[:, -1] = False
    return out.scatter_(-1, idx, srt.masked_fill(drop, NEG))


def rows(scale: float, seed: int, B: int = 64, V: int = 2048):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * scale
    p = torch.rand(B, generator=g) * 0.98 + 0.01
    p[:4] = torch.tensor([1.0, 0.999, 0.5, 1e-6])
    return logits, p


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 30.0])
def test_the_nucleus_equals_the_sort_based_mask(scale):
    logits, p = rows(scale, seed=int(scale * 100))
    ours = top_p_by_values_(logits.clone(), p)
    ref = sorted_top_p(logits, p)
    assert torch.equal(ours == NEG, ref == NEG)
    assert torch.equal(ours[ours != NEG], logits[ours != NEG])  # kept logits untouched
    assert (ours != NEG).sum(-1).min() >= 1  # the most probable token always stays


@needs_vllm
def test_the_nucleus_equals_vllms_own_mask():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    for scale in (0.1, 2.0, 10.0):
        logits, p = rows(scale, seed=7)
        vllm_mask = apply_top_k_top_p_pytorch(logits.clone(), None, p, allow_cpu_sync=True) == NEG
        assert torch.equal(top_p_by_values_(logits.clone(), p) == NEG, vllm_mask)


def test_tied_probabilities_at_the_boundary_all_stay_and_the_kept_mass_is_at_least_p():
    logits = torch.zeros(3, 10)  # ten equal tokens: no strict subset has the boundary to itself
    logits[2, :3] = 5.0  # three tied favourites, then seven tied others
    p = torch.tensor([0.35, 1e-3, 0.5])
    out = top_p_by_values_(logits.clone(), p)
    assert (out[:2] != NEG).all()  # every tied token stays: dropping some would pick among equals
    assert torch.equal(out[2] != NEG, torch.arange(10) < 3)
    for scale in (0.5, 3.0):
        logits, p = rows(scale, seed=3)
        out = top_p_by_values_(logits.clone(), p)
        kept = torch.where(out != NEG, logits.softmax(-1), 0.0).sum(-1)
        assert (kept >= p - 1e-5).all()


@needs_vllm
def test_the_plugin_routes_cpu_top_p_only_calls(monkeypatch):
    from vllm.v1.sample.ops import topk_topp_sampler as sampler

    # vLLM's own: an engine started in this process earlier has already had the plugin patch it
    original = getattr(sampler.apply_top_k_top_p, "__wrapped__", sampler.apply_top_k_top_p)
    monkeypatch.setattr(sampler, "apply_top_k_top_p", original)  # what was there comes back after the test
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    monkeypatch.setenv(TOP_P_ENV, "0")
    register()
    assert sampler.apply_top_k_top_p is original  # off unless asked for
    monkeypatch.setenv(TOP_P_ENV, "1")
    register()
    register()  # a second load in one process wraps once
    patched = sampler.apply_top_k_top_p
    assert patched is not original and patched.__wrapped__ is original
    calls = []
    monkeypatch.setattr(vllm_plugin, "top_p_by_values_", lambda lg, p: calls.append("ours") or lg)
    logits, p = rows(1.0, seed=1, B=4, V=64)
    patched(logits.clone(), None, p)
    assert calls == ["ours"]
    k = torch.full((4,), 5)
    with_k = patched(logits.clone(), k, p)  # top-k as well: vLLM's own
    assert calls == ["ours"] and ((with_k != NEG).sum(-1) <= 5).all()
