"""On CUDA: the in-process engines' own stream and its ordering against the trainer's (``engines/streams.py``),
and the megatron engine's decode steps replayed from CUDA graphs against the same steps run eagerly."""

import concurrent.futures
import threading

import pytest
import torch

from nemo_orchestra.export.qwen3 import full_state_dict
from nemo_orchestra.rollout.engines import EngineContext, start_engine
from nemo_orchestra.rollout.engines.megatron import MegatronEngine
from nemo_orchestra.rollout.engines.streams import EngineStream
from tests.integration.test_megatron_engine import LP_RTOL, LP_TOL, VOCAB, make_prompts, new_policy

pytestmark = pytest.mark.gpu
SLEEP_CYCLES = 200_000_000  # ~0.1 s of the trainer's stream busy on any current GPU


def on_thread(fn):
    """``fn()`` on a thread of its own, as the engine thread runs engine calls (its exception raised here)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def test_a_load_runs_after_the_trainers_work_and_before_its_next():
    dev = torch.device("cuda", torch.cuda.current_device())
    stream = EngineStream(dev)
    src, dst = torch.zeros(1 << 20, device=dev), torch.zeros(1 << 20, device=dev)

    def load(after_trainer: bool):
        with stream.run(after_trainer=after_trainer):
            assert torch.cuda.current_stream(dev) == stream.stream != torch.cuda.default_stream(dev)
            dst.copy_(src)

    torch.cuda._sleep(SLEEP_CYCLES)  # the trainer's queue: busy, then the new weights
    src.fill_(1.0)
    on_thread(lambda: load(True))
    src.fill_(2.0)  # the trainer's next step: after the load's copy
    torch.cuda.synchronize()
    assert bool((dst == 1.0).all())
    # the control: unordered, the copy runs while the trainer's stream is still asleep, before its fill
    torch.cuda._sleep(SLEEP_CYCLES)
    src.fill_(3.0)
    on_thread(lambda: load(False))
    stream.stream.synchronize()
    copied = dst.clone()
    torch.cuda.synchronize()
    assert bool((copied == 2.0).all())


def test_generate_and_load_run_on_the_engines_stream():
    cfg, policy = new_policy()
    gpt = policy.module
    tok = type("Tok", (), {"get_vocab": dict, "eos_token_id": 1, "pad_token_id": 0})()
    ctx = EngineContext(
        cfg.model, VOCAB, tok, policy.device, rollout=cfg.rollout, seed=3, model=gpt, parallel=cfg.parallel
    )
    state = full_state_dict(gpt)
    for name in ("megatron", "megatron_copy", "hf"):
        engine = start_engine(name, ctx, state)
        seen = []
        model = getattr(engine.model, "decoder", engine.model)  # the megatron engines run the model's pieces
        hook = model.register_forward_pre_hook(lambda *_: seen.append(torch.cuda.current_stream()))
        try:
            if hasattr(engine, "decode"):
                engine.decode = "dynamic"  # every step's forward runs in Python (a replayed graph has no hooks)
            on_thread(lambda: engine.generate(make_prompts(), 4, 0.0, 1.0, []))
        finally:
            hook.remove()
        assert seen and all(s == engine.stream.stream for s in seen), name
        assert engine.stream.stream != torch.cuda.default_stream(policy.device)


def test_graphs_replay_the_static_steps_and_read_the_weights_in_place():
    cfg, policy = new_policy()
    gpt = policy.module
    static, graphs = MegatronEngine(gpt, policy.device, seed=3), MegatronEngine(gpt, policy.device, seed=3)
    static.decode = "static"
    assert graphs.decode == "graphs"  # the default on CUDA at TP=1
    prompts = make_prompts(seed=6)
    (probe,) = static.generate(prompts[:1], 12, 0.0, 1.0, [])
    stops = probe.token_ids[2:9:3]  # rows leave at different steps: smaller shapes
    calls = [
        (prompts, 12, 0.0, 1.0, stops, None),
        (prompts, 12, 0.9, 0.8, stops, [1, 2, 3, 4]),
        (prompts[1:2], 12, 0.0, 1.0, [], None),  # one row: another captured shape whatever the stops do
    ]
    for round in range(2):
        for call in calls:
            a, b = (on_thread(lambda e=e: e.generate(*call[:5], seeds=call[5])) for e in (static, graphs))
            assert [g.token_ids for g in a] == [g.token_ids for g in b]
            for x, y in zip(a, b):
                assert x.logprobs == pytest.approx(y.logprobs, abs=LP_TOL, rel=LP_RTOL)
        if round == 0:
            captured = dict(graphs._static.graphs)
    assert len(captured) > 1 and graphs._static.graphs == captured  # the second round captured nothing new
    assert graphs.graphs_captured == len(captured) and graphs.capture_s > 0  # what the benchmarks report
    assert static.graphs_captured == 0
    with torch.no_grad():
        for p in gpt.parameters():
            p.mul_(-1.0)
    try:  # the replayed steps read the parameters where they are
        a, b = (on_thread(lambda e=e: e.generate(prompts, 12, 0.0, 1.0, [])) for e in (static, graphs))
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
    finally:
        with torch.no_grad():
            for p in gpt.parameters():
                p.mul_(-1.0)


def test_graphs_are_captured_while_the_trainers_thread_works(monkeypatch):
    """With rollouts ahead the engine thread meets new decode shapes, and captures them, while the trainer's
    thread runs its step: kernels on the default stream, allocations and frees, host reads of results. Each
    capture here is held open until a whole trainer iteration has run inside it. The captures (thread-local)
    and the trainer's work both go through, and the replayed steps make the eager steps' tokens."""
    cfg, policy = new_policy()
    gpt, dev = policy.module, policy.device
    static, graphs = MegatronEngine(gpt, dev, seed=3), MegatronEngine(gpt, dev, seed=3)
    static.decode = "static"
    prompts = make_prompts(seed=8)
    done, capturing, overlapped = threading.Event(), threading.Event(), threading.Event()
    begin = torch.cuda.CUDAGraph.capture_begin

    def capture_begin(self, *args, **kwargs):
        begin(self, *args, **kwargs)
        overlapped.clear()
        capturing.set()
        try:
            assert overlapped.wait(30), "no iteration of the trainer's thread ran within the capture"
        finally:
            capturing.clear()

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)

    def trainer() -> int:
        steps, a = 0, torch.randn(512, 512, device=dev)
        while not done.is_set():
            within = capturing.is_set()
            b = a @ a
            scratch = torch.empty((1 + steps % 7) << 18, device=dev)  # allocation sizes the pool does not hold
            scratch.fill_(float(b[0, 0]))  # a read on the host: waits for the trainer's stream
            del scratch
            steps += 1
            if within:
                overlapped.set()
        return steps

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        working = pool.submit(trainer)
        try:
            got = pool.submit(lambda: graphs.generate(prompts, 12, 0.0, 1.0, [])).result()
        finally:
            done.set()
        assert working.result() > 0
    assert graphs.graphs_captured > 0
    want = on_thread(lambda: static.generate(prompts, 12, 0.0, 1.0, []))
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
