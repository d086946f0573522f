"""The Megatron layer spec's core attention: the Triton kernel (interpreted on CPU) equals the
PyTorch reference inside the whole model, forward and backward."""

import copy
import os

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.megatron.attention import resolve_attention_backend
from nemo_orchestra.megatron.forward import (
    forward_logprobs,
    packed_params,
    token_logprobs,
)
from nemo_orchestra.megatron.model import build_gpt_model
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.train.packing import pack
from tests.helpers import traj


def test_auto_picks_the_reference_without_cuda():
    assert resolve_attention_backend("auto") == ("triton" if torch.cuda.is_available() else "torch")
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_attention_backend("flash")


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs CUDA or TRITON_INTERPRET=1",
)
def test_triton_backend_equals_torch_backend_in_the_model():
    base = ["model.num_layers=1", "model.hidden_size=64", "model.ffn_hidden_size=128"]
    info = init_distributed(load_config(base).parallel, seed=3)
    (batch,) = pack(
        [traj(ids=list(range(5, 18)), mask=[1] * 13), traj(ids=list(range(30, 37)), mask=[1] * 7)], capacity=64
    )
    results, weights = {}, None
    for backend in ("torch", "triton"):
        cfg = load_config(base + [f"model.attention_backend={backend}"])
        gpt = build_gpt_model(cfg.model, cfg.parallel, 128, info.device)
        if weights is None:  # one set of weights for both (on CUDA Megatron's RNG tracker moves on between builds)
            weights = copy.deepcopy(gpt.state_dict())
        else:
            gpt.load_state_dict(weights)
        lp = forward_logprobs(gpt, batch, info.device)
        gpt.train()
        logits = gpt(
            batch.input_ids_T[None].to(info.device),
            batch.position_ids_T[None].to(info.device),
            None,
            packed_seq_params=packed_params(batch, info.device),
        )
        target, mask = batch.target_ids_T.to(info.device), batch.loss_mask_T.to(info.device)
        (-(token_logprobs(logits, target) * mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in gpt.named_parameters() if "linear_qkv" in n}
        results[backend] = (lp, grads)
    # On CUDA the kernel's fp32 dots are tf32 (10-bit mantissa); the interpreter's are fp32.
    cuda = info.device.type == "cuda"
    lp_tol = dict(atol=2e-3, rtol=2e-2) if cuda else dict(atol=1e-5, rtol=1e-5)
    grad_tol = dict(atol=2e-3, rtol=2e-2) if cuda else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], **lp_tol)
    for name, g in results["torch"][1].items():
        torch.testing.assert_close(results["triton"][1][name], g, **grad_tol)
