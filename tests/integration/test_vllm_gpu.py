"""The vLLM engine's CUDA paths: the IPC weight sync against the file sync, and sleep/wake around a sync.
Skipped without CUDA and vLLM."""

import importlib.util

import pytest
import torch

from nemo_orchestra.config import load_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None, reason="needs CUDA and vllm"
    ),
]
VOCAB = 256


@pytest.fixture(scope="module")
def setup():
    from nemo_orchestra.export.qwen3 import full_state_dict
    from nemo_orchestra.megatron.model import build_gpt_model
    from nemo_orchestra.megatron.parallel import init_distributed
    from nemo_orchestra.rollout.engines.vllm import VLLMEngine

    cfg = load_config(["model.params_dtype=bf16"])
    info = init_distributed(cfg.parallel, seed=7)
    torch.manual_seed(0)
    gpt = build_gpt_model(cfg.model, cfg.parallel, VOCAB, info.device).eval()
    state = full_state_dict(gpt)
    engine = VLLMEngine(
        cfg.model,
        VOCAB,
        None,
        info.device,
        state,
        max_model_len=256,
        sleep_mode=True,
        kv_cache_bytes=64 * 1024**2,
        gpu_memory_utilization=0.5,
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 30)]
    yield engine, state, prompts
    engine.close()


def test_ipc_sync_equals_file_sync(setup):
    engine, state, prompts = setup
    other = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
    out = {}
    for transfer in ("file", "memory"):
        engine.transfer = transfer
        engine.load_weights(other)
        engine.load_weights(state)
        out[transfer] = engine.generate(prompts, 8, 0.0, 1.0, [])
    for a, b in zip(out["file"], out["memory"]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_sleep_frees_memory_and_a_synced_engine_generates_as_before(setup):
    engine, state, prompts = setup
    engine.transfer = "memory"
    before = engine.generate(prompts, 8, 0.0, 1.0, [])
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert engine.asleep and torch.cuda.mem_get_info()[0] > free_awake  # weights and KV cache released
    engine.wake_up()
    engine.load_weights(state)  # level 2 dropped the weights: the sync restores them
    after = engine.generate(prompts, 8, 0.0, 1.0, [])
    assert [g.token_ids for g in after] == [g.token_ids for g in before]
