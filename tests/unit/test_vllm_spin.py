"""An engine that shares a CPU's cores with the trainer (``cpus`` given: rollouts ahead of training)
makes vLLM's processes block instead of spinning while they wait for each other
(``rollout/engines/vllm_plugin.py``); the variable is set for the engine's start only."""

import importlib.util
import os
import time

import psutil
import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.rollout.engines.vllm_memory import pinned_to
from nemo_orchestra.rollout.engines.vllm_plugin import ENV, register

VOCAB = 256
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def children_cpu_s(proc: psutil.Process) -> float:
    total = 0.0
    for c in proc.children(recursive=True):
        try:
            t = c.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


@needs_vllm
def test_an_engine_on_shared_cores_leaves_them_idle_between_calls():
    from nemo_orchestra.hf.qwen3 import full_state_dict
    from nemo_orchestra.megatron.model import build_gpt_model
    from nemo_orchestra.megatron.parallel import init_distributed
    from nemo_orchestra.rollout.engines.vllm import VLLMEngine

    cfg = load_config([])
    info = init_distributed(cfg.parallel, seed=3)
    gpt = build_gpt_model(cfg.model, cfg.parallel, VOCAB, info.device).eval()
    cores = sorted(os.sched_getaffinity(0))
    engine = VLLMEngine(
        cfg.model, VOCAB, None, torch.device("cpu"), full_state_dict(gpt), max_model_len=128, cpus=cores[:1]
    )
    try:
        assert ENV not in os.environ  # set for the engine's processes only
        me = psutil.Process()
        for _ in range(2):
            engine.generate([[5, 6, 7]] * 8, 16, temperature=1.0, top_p=1.0, stop_ids=[])
            before = children_cpu_s(me)
            time.sleep(0.6)  # vLLM's own default spins for 1 s after each message
            idle = children_cpu_s(me) - before
            assert idle < 0.15, f"vLLM's processes used {idle:.2f} s of CPU in 0.6 s between calls"
    finally:
        engine.close()


def test_pinned_to_sets_the_spin_and_the_binding_for_the_start_only_and_keeps_the_users(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with pinned_to(torch.device("cpu"), [0]):
        assert os.environ[ENV] == "0" and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert ENV not in os.environ and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    with pinned_to(torch.device("cpu"), None):  # synchronous: vLLM's defaults
        assert ENV not in os.environ
    monkeypatch.setenv(ENV, "0.5")
    with pinned_to(torch.device("cpu"), [0]):
        assert os.environ[ENV] == "0.5"
    assert os.environ[ENV] == "0.5"
    for bad in ("fast", "-1"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=f"{ENV}='{bad}': must be a number of seconds >= 0"):
            with pinned_to(torch.device("cpu"), [0]):
                pass
        assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # nothing set on the way out


@needs_vllm
def test_the_plugin_sets_how_long_a_reader_spins_and_only_when_asked(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    class Reader:
        is_reader, busy_loop_s = True, 1.0

    waited = []
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", lambda self, timeout_ms=None: waited.append(self))
    monkeypatch.delattr(shm_broadcast.SpinCondition, "_nemo_orchestra_spin_s", raising=False)
    monkeypatch.delenv(ENV, raising=False)
    register()
    r = Reader()
    shm_broadcast.SpinCondition.wait(r)
    assert r.busy_loop_s == 1.0  # not asked: vLLM's default
    monkeypatch.setenv(ENV, "0")
    register()
    shm_broadcast.SpinCondition.wait(r)
    assert r.busy_loop_s == 0.0 and waited == [r, r]
    del shm_broadcast.SpinCondition._nemo_orchestra_spin_s
    monkeypatch.setenv(ENV, "nonsense")
    register()  # a bad value leaves vLLM as it is, with a warning
    assert not hasattr(shm_broadcast.SpinCondition, "_nemo_orchestra_spin_s")
