"""FP8 through TransformerEngine: a clear error without it (CPU), one training step with it (GPU)."""

import importlib.util

import pytest
import torch

from nemo_orchestra.config import ConfigError, load_config

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
TINY = [
    "model.hidden_size=128",
    "model.ffn_hidden_size=384",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.head_dim=32",
    "model.num_layers=2",
]


@pytest.mark.skipif(HAVE_TE, reason="transformer-engine is installed")
@pytest.mark.parametrize(
    "override",
    [
        ["model.fp8=hybrid", "model.params_dtype=bf16"],
        ["model.fp8=e4m3", "model.fp8_recipe=tensorwise", "model.params_dtype=bf16"],
        ["model.attention_backend=te"],
    ],
)
def test_fp8_or_te_without_transformer_engine_names_the_package(override):
    from nemo_orchestra.megatron.model import build_gpt_model

    cfg = load_config([*TINY, *override])
    with pytest.raises(ImportError, match="transformer-engine"):
        build_gpt_model(cfg.model, cfg.parallel, 256, torch.device("cpu"))


def test_fp8_needs_bf16_weights():
    with pytest.raises(ConfigError, match="model.fp8"):
        load_config(["model.fp8=hybrid", "model.params_dtype=fp32"])
    with pytest.raises(ConfigError, match="model.fp8_recipe"):
        load_config(["model.fp8_recipe=mxfp4"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TE, reason="needs transformer-engine")
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_one_fp8_training_step(recipe):
    from nemo_orchestra.megatron.parallel import init_distributed
    from nemo_orchestra.train.packing import pack
    from nemo_orchestra.train.learner import build_learner
    from nemo_orchestra.train.step import warm_start_loss_fn, train_step
    from tests.helpers import traj

    cfg = load_config(
        [
            *TINY,
            "model.fp8=hybrid",
            f"model.fp8_recipe={recipe}",
            "model.params_dtype=bf16",
            "model.attention_backend=te",
            "optim.lr=1e-3",
        ]
    )
    info = init_distributed(cfg.parallel, seed=0)
    policy = build_learner(cfg, 256, info.device)
    ids = torch.randint(1, 256, (60,)).tolist()
    batches = pack(
        [traj(ids=ids, mask=[0] * 10 + [1] * 50), traj(ids=ids[:40], mask=[1] * 40)], 128, pad_to_multiple=16
    )  # FP8 GEMMs want token counts divisible by 16
    first = train_step(policy, batches, warm_start_loss_fn)
    second = train_step(policy, batches, warm_start_loss_fn)
    assert first["train/step_skipped"] == 0.0 and torch.isfinite(torch.tensor(first["loss/nll"]))
    assert second["loss/nll"] < first["loss/nll"]
