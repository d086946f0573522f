"""Our THD rotary embedding (``nemo_orchestra/megatron/rope.py``) equals Megatron-Core's, values and
gradients to the bit, with the pack's own frequency rows (shared prompts) and with per-sequence
positions; its cos and sin are computed once per frequency tensor."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from nemo_orchestra.megatron import rope


class Group:
    def __init__(self, size=1):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


CONFIG = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)


def pack(dtype, per_token, rot=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [37, 120, 5, 200]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = sum(lens) if per_token else max(lens)
    freqs = torch.randn(rows, 1, 1, rot, generator=g) * 3
    t = torch.randn(sum(lens), 4, 64, generator=g).to(dtype).requires_grad_()
    return t, freqs, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("rot", [64, 32])
def test_it_equals_megatrons_to_the_bit_with_its_gradient(dtype, per_token, rot):
    t, freqs, cu = pack(dtype, per_token, rot)
    dout = torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = rope_utils.apply_rotary_pos_emb(t, freqs, CONFIG, cu_seqlens=cu, cp_group=Group())
    (want_grad,) = torch.autograd.grad(want, t, dout)
    for _ in range(2):  # computed, then from the cache
        got = rope.apply_rotary_pos_emb(t, freqs, CONFIG, cu_seqlens=cu, cp_group=Group())
        (got_grad,) = torch.autograd.grad(got, t, dout)
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad)


def test_cos_and_sin_are_computed_once_per_frequency_tensor(monkeypatch):
    t, freqs, cu = pack(torch.float32, True)
    calls = []
    cos = torch.cos
    monkeypatch.setattr(torch, "cos", lambda x: calls.append(x.shape) or cos(x))
    for _ in range(3):
        rope.apply_rotary_pos_emb(t, freqs, CONFIG, cu_seqlens=cu, cp_group=Group())
    assert len(calls) == 1
    other = freqs.clone()  # the next forward pass's frequencies
    rope.apply_rotary_pos_emb(t, other, CONFIG, cu_seqlens=cu, cp_group=Group())
    assert len(calls) == 2


def test_other_cases_go_to_megatrons_function(monkeypatch):
    t, freqs, cu = pack(torch.float32, True)
    seen = []
    monkeypatch.setattr(rope_utils, "apply_rotary_pos_emb", lambda *a, **k: seen.append(k) or "megatron")
    cases = [
        dict(config=CONFIG, cu_seqlens=None, cp_group=Group()),
        dict(config=SimpleNamespace(**{**vars(CONFIG), "apply_rope_fusion": True}), cu_seqlens=cu, cp_group=Group()),
        dict(config=SimpleNamespace(**{**vars(CONFIG), "rotary_interleaved": True}), cu_seqlens=cu, cp_group=Group()),
        dict(config=CONFIG, cu_seqlens=cu, cp_group=Group(2)),
        dict(config=CONFIG, cu_seqlens=cu, cp_group=None),
    ]
    for case in cases:
        config = case.pop("config")
        assert rope.apply_rotary_pos_emb(t, freqs, config, **case) == "megatron"
    assert len(seen) == len(cases)


def test_install_puts_it_in_megatrons_attention():
    from megatron.core.transformer import attention

    rope.install()
    assert attention.apply_rotary_pos_emb is rope.apply_rotary_pos_emb
