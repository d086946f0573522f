"""The colocation memory plan of both Qwen3-8B recipes on 80 GiB H100s, worked by hand, and its refusals."""

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.train.memory_plan import GiB, RESERVED, check, main, plan

H100 = 80 * GiB
QWEN3_8B_PARAMS = 8_190_735_360  # Qwen/Qwen3-8B's safetensors: 16,381,470,720 bytes of bf16
V, H, L, T = 151936, 4096, 36, 16384  # vocabulary, hidden, layers, the longest pack (rollout.max_context)
KV_PER_TOKEN = 2 * L * 8 * 128 * 2  # K and V, 8 KV heads of 128, bf16: 144 KiB


def _cfg(recipe, *extra):
    return load_config([f"recipe={recipe}", *extra])


@pytest.mark.parametrize("recipe,world,dp", [("qwen3_8b_1n8g", 8, 4), ("qwen3_8b_2n8g", 16, 8)])
def test_8b_recipes_plan_by_hand(recipe, world, dp):
    p = plan(_cfg(recipe), V, world, H100)
    shard = QWEN3_8B_PARAMS // 2  # tp=2, pp=1
    assert p.weights == 2 * shard and p.grads == 4 * shard  # bf16 weights, fp32 gradient buffers
    assert p.optimizer == 12 * shard // dp  # fp32 master + Adam m, v, sharded over data parallel
    assert p.reference == 0  # reference.offload: true
    assert p.activations == L * T * H * 2 + T * H * 22  # recompute: layer inputs + one layer (10 + 24/2) T H
    assert p.logits == 2 * T * (V // 2) * 4
    assert p.engine == QWEN3_8B_PARAMS * 2 + 2 * GiB  # the engine's full bf16 model + workspace
    assert p.budget == int(0.9 * H100)
    assert p.kv_cache == p.budget - (p.weights + p.grads + p.optimizer + RESERVED + p.engine)
    assert p.rollout == p.budget and p.training < p.budget  # the engine sleeps while training
    q_k_v = L * H * (32 + 2 * 8) * 128  # the q/k/v rows the Hugging Face mapping copies
    assert p.gathered == (QWEN3_8B_PARAMS + q_k_v) * 2 + 512 * 1024**2  # full bf16 weights + copies + a bucket
    assert p.sync == p.weights + p.grads + p.optimizer + RESERVED + p.engine + p.gathered <= p.budget
    assert p.kv_cache // KV_PER_TOKEN >= 8 * T  # room for 8 full-length rollouts at once
    check(p, _cfg(recipe))


def test_the_tau2_recipe_fits_full_length_conversations():
    """32k-token packs and rollouts: recompute keeps the activations in the budget, and the KV cache holds at
    least four conversations of the full context at once."""
    cfg = _cfg("qwen3_8b_tau2")
    p = plan(cfg, V, 8, H100)
    T2 = cfg.rollout.max_context
    assert T2 == cfg.parallel.microbatch_tokens == 32768
    assert p.activations == L * T2 * H * 2 + T2 * H * 22 and p.logits == 2 * T2 * (V // 2) * 4
    assert p.kv_cache // KV_PER_TOKEN >= 4 * T2
    check(p, cfg)
    full = _cfg("qwen3_8b_tau2", "parallel.activation_recompute=false")
    with pytest.raises(ValueError):  # without recompute the 32k packs' activations do not fit
        check(plan(full, V, 8, H100), full)


def test_the_old_kv_reservation_of_32_full_sequences_is_refused():
    """32 sequences of 16,384 tokens: 72 GiB of KV cache for Qwen3-8B, as the engine reserved before."""
    assert 32 * T * KV_PER_TOKEN == 72 * GiB
    cfg = _cfg("qwen3_8b_1n8g", "rollout.kv_cache_gb=72")
    p = plan(cfg, V, 8, H100)
    with pytest.raises(ValueError, match=r"rollout phase needs .* rollout\.kv_cache_gb \(72\.0\)"):
        check(p, cfg)


def test_a_weight_sync_that_cannot_gather_the_full_weights_is_refused():
    cfg = _cfg("qwen3_8b_1n8g", "reference.offload=false")  # a bf16 reference on the GPU: 7.6 GiB more
    p = plan(cfg, V, 8, H100)
    assert p.reference == p.weights
    with pytest.raises(ValueError, match="the weight sync needs .* reference.offload=true"):
        check(p, cfg)


def test_without_recompute_the_training_phase_is_refused_naming_the_keys():
    cfg = _cfg("qwen3_8b_1n8g", "parallel.activation_recompute=false")
    p = plan(cfg, V, 8, H100)
    assert p.activations == L * T * H * 22  # T H (10 + 24 / tp) bf16 bytes a layer
    with pytest.raises(ValueError, match="training phase needs .* parallel.activation_recompute=true"):
        check(p, cfg)


def test_an_engine_kept_awake_must_leave_one_sequence_of_kv():
    cfg = _cfg("qwen3_8b_1n8g", "rollout.sleep_while_training=false")
    p = plan(cfg, V, 8, H100)
    assert p.training == p.resident + p.activations + p.logits + p.engine + p.kv_cache  # all held together
    assert p.kv_cache == p.budget - (p.resident + p.engine + p.gathered)  # what the weight sync leaves
    with pytest.raises(ValueError, match="less than one sequence of rollout.max_context=16384"):
        check(p, cfg)


def test_the_plan_cli_prints_the_table_and_exits_1_when_it_does_not_fit(capsys):
    assert main(["recipe=qwen3_8b_1n8g", "world_size=8", "gpu_gb=80"]) == 0
    out = capsys.readouterr().out
    assert "= rollout phase" in out and "kv cache holds" in out and out.strip().endswith("fits")
    assert main(["recipe=qwen3_8b_1n8g", "world_size=8", "gpu_gb=40"]) == 1
    assert "does not fit: memory plan" in capsys.readouterr().err


def test_activation_recompute_changes_no_gradient():
    """The key the plan relies on: Megatron's full recompute gives the same gradients, bit for bit."""
    from nemo_orchestra.megatron.forward import packed_params, token_logprobs
    from nemo_orchestra.megatron.model import build_gpt_model
    from nemo_orchestra.megatron.parallel import init_distributed
    from nemo_orchestra.train.packing import pack
    from tests.helpers import traj

    base = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128"]
    info = init_distributed(load_config(base).parallel, seed=3)
    (batch,) = pack(
        [traj(ids=list(range(5, 18)), mask=[1] * 13), traj(ids=list(range(30, 37)), mask=[1] * 7)], capacity=64
    )
    grads = {}
    for recompute in ("false", "true"):
        cfg = load_config(base + [f"parallel.activation_recompute={recompute}"])
        torch.manual_seed(0)
        gpt = build_gpt_model(cfg.model, cfg.parallel, 128, info.device).train()
        logits = gpt(
            batch.input_ids_T[None],
            batch.position_ids_T[None],
            None,
            packed_seq_params=packed_params(batch, info.device),
        )
        (-(token_logprobs(logits, batch.target_ids_T) * batch.loss_mask_T).sum()).backward()
        grads[recompute] = {n: p.grad.clone() for n, p in gpt.named_parameters()}
        assert gpt.config.recompute_granularity == ("full" if recompute == "true" else None)
    for name, g in grads["false"].items():
        assert torch.equal(g, grads["true"][name]), name


def test_both_8b_recipes_name_their_task_files():
    for recipe in ("qwen3_8b_1n8g", "qwen3_8b_2n8g"):
        data = _cfg(recipe).data
        assert data.train_path == "data/toolscale/train.jsonl" and data.eval_path == "data/toolscale/eval.jsonl"


def test_a_missing_task_file_names_the_key(tmp_path):
    from nemo_orchestra.train.build import load_tasks

    cfg = load_config([f"data.train_path={tmp_path / 'none.jsonl'}"])
    with pytest.raises(FileNotFoundError, match="data.train_path: no task file at"):
        load_tasks(cfg)
