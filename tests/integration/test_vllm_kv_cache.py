"""The vLLM engine's KV cache without a memory plan or rollout.kv_cache_gb: room for every sequence a
run keeps live (a cache that is short makes vLLM preempt, recompute, and prefill evicted prefixes
again), at least the fixed 32 of before, within a share of the memory on a CPU."""

import logging

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.rollout.engines import EngineContext
from nemo_orchestra.rollout.engines.vllm import (
    KV_MEMORY_SHARE,
    KV_SEQUENCES,
    VLLMEngine,
    available_memory_bytes,
    default_kv_bytes,
)
from nemo_orchestra.train.run_plan import live_sequences

CPU = torch.device("cpu")
GiB = 1024**3


@pytest.fixture
def model():
    return load_config([]).model  # the tiny default


def test_it_holds_the_live_sequences_at_full_context(model):
    per_sequence = 2 * model.num_layers * model.num_query_groups * model.head_dim * 2 * 1024  # K and V, bf16, tokens
    assert default_kv_bytes(model, torch.bfloat16, 1024, 128, CPU, available=64 * GiB) == 128 * per_sequence
    assert default_kv_bytes(model, torch.float32, 1024, 128, CPU, available=64 * GiB) == 2 * 128 * per_sequence
    assert default_kv_bytes(model, torch.bfloat16, 1024, 8, CPU, available=64 * GiB) == KV_SEQUENCES * per_sequence
    assert default_kv_bytes(model, torch.bfloat16, 1024, None, CPU, available=64 * GiB) == KV_SEQUENCES * per_sequence
    # on a GPU the memory plan sizes it; a direct build gets the live sequences
    assert default_kv_bytes(model, torch.bfloat16, 1024, 128, torch.device("cuda")) == 128 * per_sequence


def test_on_a_cpu_it_stays_within_a_share_of_the_memory_and_says_so(model, caplog):
    per_sequence = 2 * model.num_layers * model.num_query_groups * model.head_dim * 2 * 1024
    available = int(100 * per_sequence / KV_MEMORY_SHARE)  # room for 100 of the 128
    with caplog.at_level(logging.WARNING, logger="nemo_orchestra.rollout.engines.vllm"):
        assert default_kv_bytes(model, torch.bfloat16, 1024, 128, CPU, available=available) == 100 * per_sequence
    assert "128 sequences" in caplog.text and "holds 100" in caplog.text and "rollout.kv_cache_gb" in caplog.text
    caplog.clear()
    # never below the fixed default, and no warning where the live sequences fit in it
    assert (
        default_kv_bytes(model, torch.bfloat16, 1024, 128, CPU, available=per_sequence) == KV_SEQUENCES * per_sequence
    )
    assert default_kv_bytes(model, torch.bfloat16, 1024, 16, CPU, available=per_sequence) == KV_SEQUENCES * per_sequence
    assert caplog.text.count("holds") == 1


def test_live_sequences_are_a_steps_rollouts_times_the_steps_in_flight():
    cfg = load_config(["data.prompts_per_step=16", "rollout.group_size=8"])
    assert live_sequences(cfg) == 128
    assert (
        live_sequences(
            load_config(
                ["data.prompts_per_step=16", "rollout.group_size=8", "rollout.steps_ahead=1", "loss.tis_cap=2.0"]
            )
        )
        == 128
    )
    assert (
        live_sequences(
            load_config(
                ["data.prompts_per_step=16", "rollout.group_size=8", "rollout.steps_ahead=2", "loss.tis_cap=2.0"]
            )
        )
        == 256
    )


def test_the_engine_is_built_with_the_runs_live_sequences(model, monkeypatch):
    seen = {}
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, *a, **kw: seen.update(kw))
    cfg = load_config([])
    VLLMEngine.create(EngineContext(model, 256, None, CPU, rollout=cfg.rollout, live_sequences=96), {"w": None})
    assert seen["kv_sequences"] == 96 and seen["kv_cache_bytes"] is None
    VLLMEngine.create(
        EngineContext(
            model, 256, None, CPU, rollout=load_config(["rollout.kv_cache_gb=0.5"]).rollout, live_sequences=96
        ),
        {"w": None},
    )
    assert seen["kv_cache_bytes"] == GiB // 2  # a size set by hand wins


def test_the_memory_available_is_what_the_machine_still_has():
    import psutil

    assert 0 < available_memory_bytes() <= psutil.virtual_memory().total
