"""An engine that shares a CPU's cores with the trainer (``cpus`` given: rollouts ahead of training)
makes vLLM's processes block instead of spinning while they wait for each other, and never lose
seconds to a lost wake-up (``rollout/engines/vllm_plugin.py``); the variable is set for the engine's
start only."""

import importlib.util
import multiprocessing
import os
import time

import psutil
import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.rollout.engines.vllm_memory import pinned_to
from nemo_orchestra.rollout.engines.vllm_plugin import ENV, PINNED_SPIN_S, RECHECK_MS, register

VOCAB = 256
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def burn(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


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
    from nemo_orchestra.export.qwen3 import full_state_dict
    from nemo_orchestra.megatron.model import build_gpt_model
    from nemo_orchestra.megatron.parallel import init_distributed
    from nemo_orchestra.rollout.engines.vllm import VLLMEngine

    cfg = load_config([])
    info = init_distributed(cfg.parallel, seed=3)
    gpt = build_gpt_model(cfg.model, cfg.parallel, VOCAB, info.device).eval()
    cores = sorted(os.sched_getaffinity(0))
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = VLLMEngine(
        cfg.model, VOCAB, None, torch.device("cpu"), full_state_dict(gpt), max_model_len=128, cpus=cores[:1]
    )
    try:
        assert ENV not in os.environ  # set for the engine's processes only
        me = psutil.Process()
        # all the engine's processes run on its cores, the engine core as well as the bound worker
        engine_procs = [p for p in me.children(recursive=True) if p.pid not in earlier]
        assert len(engine_procs) >= 2
        for p in engine_procs:
            for t in p.threads():
                assert os.sched_getaffinity(t.id) == set(cores[:1]), (p.name(), t.id)
        for _ in range(2):
            engine.generate([[5, 6, 7]] * 8, 16, temperature=1.0, top_p=1.0, stop_ids=[])
            before = children_cpu_s(me)
            time.sleep(0.6)  # vLLM's own default spins for 1 s after each message
            idle = children_cpu_s(me) - before
            assert idle < 0.15, f"vLLM's processes used {idle:.2f} s of CPU in 0.6 s between calls"

        # every core busy, as the trainer and the tool service keep them: vLLM's wake-ups get lost now
        # and then (2 of 60 calls took 5 s, vLLM's own recheck, without the plugin's RECHECK_MS)
        stop = multiprocessing.get_context("spawn").Event()
        burners = [multiprocessing.get_context("spawn").Process(target=burn, args=(stop,)) for _ in cores]
        for b in burners:
            b.start()
        try:
            slow = []
            for i in range(60):
                t0 = time.perf_counter()
                engine.generate([[5, 6, 7]] * 4, 8, temperature=1.0, top_p=1.0, stop_ids=[])
                if time.perf_counter() - t0 > 2.0:
                    slow.append((i, round(time.perf_counter() - t0, 2)))
                time.sleep(0.02 * (i % 5))
            assert not slow, f"generate calls (index, seconds) that waited for a lost wake-up: {slow}"
        finally:
            stop.set()
            for b in burners:
                b.join(10)
    finally:
        engine.close()


def test_pinned_to_sets_the_spin_and_the_binding_for_the_start_only_and_keeps_the_users(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with pinned_to(torch.device("cpu"), [0]):
        assert float(os.environ[ENV]) == PINNED_SPIN_S and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"
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


@pytest.fixture
def spin_reader(monkeypatch, tmp_path):
    """``make(**kw)``: a reader of vLLM's ``SpinCondition`` on a socket nobody writes to, with vLLM's own
    ``wait`` restored (an engine started in this process may have set the plugin's), closed at the end."""
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    vllms_wait = shm_broadcast.SpinCondition.wait
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", getattr(vllms_wait, "__wrapped__", vllms_wait))
    monkeypatch.delattr(shm_broadcast.SpinCondition, "_nemo_orchestra_spin_s", raising=False)
    context, readers = zmq.Context(), []

    def make(**kw):
        readers.append(shm_broadcast.SpinCondition(True, context, f"ipc://{tmp_path}/notify{len(readers)}", **kw))
        return readers[-1]

    yield make
    for r in readers:
        r.local_notify_socket.close(linger=0)
        r.read_cancel_socket.close(linger=0)
        r.write_cancel_socket.close(linger=0)
    context.term()


@needs_vllm
def test_a_blocked_reader_rechecks_the_buffer_itself_only_when_asked(monkeypatch, spin_reader):
    """A wake-up that never comes (vLLM drops one when its socket has one in flight) costs a blocked
    reader RECHECK_MS, not vLLM's 5 s recheck; readers that spin as vLLM's default keep its timeouts."""
    reader = spin_reader(busy_loop_s=0.0)
    monkeypatch.delenv(ENV, raising=False)
    register()  # not asked: vLLM's own timeout
    t0 = time.perf_counter()
    reader.wait(timeout_ms=300)
    assert time.perf_counter() - t0 >= 0.29
    monkeypatch.setenv(ENV, "0")
    register()
    t0 = time.perf_counter()
    reader.wait(timeout_ms=5000)  # no notification will come
    assert time.perf_counter() - t0 < 20 * RECHECK_MS / 1000


@needs_vllm
def test_a_pinned_engines_reader_spins_only_briefly_after_a_message(monkeypatch, spin_reader):
    """An engine on cores of its own (``pinned_to``): right after a message a reader spins (the next
    hand-over of a decode step comes within milliseconds, and a blocked reader lost those wake-ups),
    and once ``PINNED_SPIN_S`` has passed it blocks, as between two generate calls."""
    monkeypatch.delenv(ENV, raising=False)
    with pinned_to(torch.device("cpu"), [0]):
        register()  # as in the engine's processes, which start inside pinned_to
    reader = spin_reader()
    reader.record_read()
    t0 = time.perf_counter()
    reader.wait(timeout_ms=5000)  # within the window: a yield, no wait for a notification
    assert time.perf_counter() - t0 < 0.5 * RECHECK_MS / 1000
    assert reader.busy_loop_s == PINNED_SPIN_S
    time.sleep(2 * PINNED_SPIN_S)
    t0 = time.perf_counter()
    reader.wait(timeout_ms=5000)  # past it: blocks until the recheck (no notification comes)
    assert 0.8 * RECHECK_MS / 1000 <= time.perf_counter() - t0 < 20 * RECHECK_MS / 1000
