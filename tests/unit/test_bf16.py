"""The bf16 step (``model.params_dtype=bf16``) on CPU: bf16 weights and activations, fp32 master
weights in the optimizer, fp32 logprob and loss math. Its logprobs stay within a stated tolerance
of fp32's on the same weights, and a GRPO step moves the weights as fp32's does."""

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.megatron.forward import forward_logprobs
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.megatron.sharding import load_full_state, model_state
from nemo_orchestra.train.packing import pack
from nemo_orchestra.train.learner import build_learner
from nemo_orchestra.train.step import grpo_loss_fn, train_step
from tests.helpers import loss_cfg, traj

VOCAB = 512
TINY = [
    "model.hidden_size=128",
    "model.ffn_hidden_size=384",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.head_dim=64",
    "model.num_layers=2",
]
# bf16 keeps 8 bits of mantissa: token logprobs of this model differ from fp32's by this much on average
MEAN_ABS_TOLERANCE = 0.02
MAX_ABS_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def policies():
    cfg32 = load_config(TINY)
    init_distributed(cfg32.parallel, seed=11)
    p32 = build_learner(cfg32, VOCAB, torch.device("cpu"))
    p16 = build_learner(load_config([*TINY, "model.params_dtype=bf16"]), VOCAB, torch.device("cpu"))
    full = model_state(p32.module)
    load_full_state(p16.module, lambda n: full[n], list(full))  # the same weights, rounded to bf16
    for opt in p16.optimizer.chained_optimizers:  # the fp32 master copies follow the loaded weights
        opt.reload_model_params()
    return p32, p16


def _batch():
    g = torch.Generator().manual_seed(0)
    trajs = []
    for k, adv in enumerate((1.0, -1.0, 0.5, -0.5)):
        n = 40 + 17 * k
        t = traj(ids=torch.randint(1, VOCAB, (n,), generator=g).tolist(), mask=[0] * 10 + [1] * (n - 10))
        t.advantage = adv
        trajs.append(t)
    (b,) = pack(trajs, capacity=1024)
    return b


def test_bf16_weights_with_fp32_master_copies(policies):
    _, p16 = policies
    assert {p.dtype for p in p16.module.parameters() if p.dim() == 2} == {torch.bfloat16}
    masters = [
        p
        for opt in p16.optimizer.chained_optimizers  # the distributed optimizer's shards of them
        for group in opt.shard_fp32_from_float16_groups
        for p in group
    ]
    assert masters and all(p.dtype == torch.float32 for p in masters)


def test_bf16_logprobs_within_tolerance_of_fp32(policies):
    p32, p16 = policies
    b = _batch()
    lp32 = forward_logprobs(p32.model, [b], p32.device)[0]
    lp16 = forward_logprobs(p16.model, [b], p16.device)[0]
    assert lp16.dtype == torch.float32  # logprob math in fp32 from bf16 logits
    diff = (lp16 - lp32).abs()
    assert float(diff.mean()) < MEAN_ABS_TOLERANCE and float(diff.max()) < MAX_ABS_TOLERANCE
    assert float(diff.max()) > 0  # the two precisions really differ


def test_bf16_grpo_step_moves_the_weights_as_fp32(policies):
    p32, p16 = policies
    before32, before16 = ({k: v.clone() for k, v in model_state(p.module).items()} for p in (p32, p16))
    b = _batch()
    m32 = train_step(p32, [b], grpo_loss_fn(loss_cfg()))
    m16 = train_step(p16, [b], grpo_loss_fn(loss_cfg()))
    assert m16["train/step_skipped"] == 0 and abs(m16["loss/pg"] - m32["loss/pg"]) < 0.05
    after32, after16 = model_state(p32.module), model_state(p16.module)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    d32 = (after32[name] - before32[name]).float().flatten()
    d16 = (after16[name] - before16[name]).float().flatten()
    assert d16.abs().max() > 0 and torch.nn.functional.cosine_similarity(d32, d16, dim=0) > 0.9
