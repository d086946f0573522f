"""The megatron engine (the trainer's own GPTModel, KV-cached) against an uncached re-forward, the
trainer's logprobs and the hf engine on the same weights; batching, stops, sampling, weight
updates, the TP group (2 gloo ranks) and the layouts it refuses. Each runs for every way of decoding
the device has (``MegatronEngine.decode``: dynamic and static steps; on CUDA also CUDA graphs)."""

import json
import os
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.export.qwen3 import full_state_dict
from nemo_orchestra.rollout.engines import EngineContext, GenerationEngine, capabilities, start_engine
from nemo_orchestra.rollout.engines.megatron import (
    MegatronCopyEngine,
    MegatronEngine,
    decode_attention,
    decode_mask,
    padded_length,
    padded_rows,
)
from nemo_orchestra.train.packing import pack
from nemo_orchestra.train.learner import build_learner, set_lr
from nemo_orchestra.train.step import warm_start_loss_fn, train_step
from tests.helpers import generated_logprobs, traj

VOCAB = 256
CPU = torch.device("cpu")
# engine against trainer logprobs: on CUDA (where init_distributed puts the policy) the Triton attention's fp32
# dots are tf32 (unit roundoff 2^-11), so the difference grows with the logprob: LP_TOL plus LP_RTOL of it
LP_TOL, LP_RTOL = (1e-3, 1e-3) if torch.cuda.is_available() else (1e-5, 0.0)
PROMPT_LENGTHS = (5, 17, 30, 1)
DECODES = ["dynamic", "static"] + (["graphs"] if torch.cuda.is_available() else [])


def sharpen(gpt, seed: int = 0) -> None:
    """Larger weights than the init: peaked distributions, no near-ties in greedy decoding."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.device))
            else:
                p.mul_(4.0)


def make_prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def new_policy(overrides: tuple[str, ...] = ()):
    from nemo_orchestra.megatron.parallel import init_distributed

    cfg = load_config(list(overrides))  # the tiny default: 2 layers, 4 heads x 64, a KV group per head
    info = init_distributed(cfg.parallel, seed=7)
    policy = build_learner(cfg, VOCAB, info.device)
    sharpen(policy.module)
    return cfg, policy


@pytest.fixture(scope="module", params=DECODES)
def setup(request):
    cfg, policy = new_policy()
    engine = start_engine(
        "megatron",
        EngineContext(cfg.model, VOCAB, None, policy.device, rollout=cfg.rollout, seed=3, model=policy.module),
    )
    engine.decode = request.param
    if request.param == "static":  # and the tokens copied to the host every 4 steps (CUDA's way)
        engine.sync_every = 4
    return SimpleNamespace(
        cfg=cfg, policy=policy, gpt=policy.module, engine=engine, prompts=make_prompts(), decode=request.param
    )


def decoding_as(engine, s):
    """``engine``, decoding as the fixture's engine does."""
    engine.decode, engine.sync_every = s.decode, s.engine.sync_every
    return engine


@torch.no_grad()
def uncached_greedy(gpt, prompt: list[int], n: int) -> list[int]:
    """argmax of a full forward over the growing sequence, n times."""
    gpt.eval()
    seq, dev = list(prompt), next(gpt.parameters()).device
    for _ in range(n):
        logits = gpt(torch.tensor([seq], device=dev), torch.arange(len(seq), device=dev)[None], None)
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


def assert_logprobs(gpt, prompts, gens, temperature: float = 1.0) -> None:
    for g, ref in zip(gens, generated_logprobs(gpt, prompts, gens, temperature)):
        assert len(g.logprobs) == len(g.token_ids)
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=LP_TOL, rtol=LP_RTOL)


def test_greedy_equals_uncached_reference_and_trainer_logprobs(setup):
    s = setup
    gens = s.engine.generate(s.prompts, 12, 0.0, 1.0, [])
    for p, g in zip(s.prompts, gens):
        assert g.token_ids == uncached_greedy(s.gpt, p, 12)
        assert not g.finished
    assert_logprobs(s.gpt, s.prompts, gens)


def test_batch_equals_each_prompt_alone(setup):
    s = setup
    together = s.engine.generate(s.prompts, 10, 0.0, 1.0, [])
    for p, t in zip(s.prompts, together):
        (alone,) = s.engine.generate([p], 10, 0.0, 1.0, [])
        assert alone.token_ids == t.token_ids and alone.finished == t.finished
        assert alone.logprobs == pytest.approx(t.logprobs, abs=LP_TOL, rel=LP_RTOL)
    reordered = s.engine.generate(s.prompts[::-1], 10, 0.0, 1.0, [])
    assert [g.token_ids for g in reordered[::-1]] == [g.token_ids for g in together]


def test_greedy_equals_hf_engine(setup):
    s = setup
    tok = SimpleNamespace(get_vocab=dict, eos_token_id=1, pad_token_id=0)
    hf = start_engine("hf", EngineContext(s.cfg.model, VOCAB, tok, s.policy.device), full_state_dict(s.gpt))
    ours = s.engine.generate(s.prompts, 12, 0.0, 1.0, [])
    theirs = hf.generate(s.prompts, 12, 0.0, 1.0, [])
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=max(LP_TOL, 1e-4), rel=LP_RTOL)


def test_the_copy_engine_generates_with_the_weights_it_was_last_given(setup):
    """rollout.engine=megatron_copy: the live engine's tokens on the weights of its last sync; the
    policy trained on meanwhile changes nothing until the next sync."""
    s = setup
    ctx = EngineContext(
        s.cfg.model, VOCAB, None, s.policy.device, rollout=s.cfg.rollout, seed=3, model=s.gpt, parallel=s.cfg.parallel
    )
    copy = decoding_as(start_engine("megatron_copy", ctx, full_state_dict(s.gpt)), s)
    assert isinstance(copy, GenerationEngine) and copy.model is not s.gpt
    assert not capabilities("megatron_copy").reads_policy_weights
    seeds = [11, 12, 13, 14]
    before = s.engine.generate(s.prompts, 10, 1.0, 0.9, [], seeds=seeds)
    assert [g.token_ids for g in copy.generate(s.prompts, 10, 1.0, 0.9, [], seeds=seeds)] == [
        g.token_ids for g in before
    ]
    try:
        with torch.no_grad():
            for p in s.gpt.parameters():  # the trainer moves the policy on
                p.mul_(-1.0)
        moved = s.engine.generate(s.prompts, 10, 0.0, 1.0, [])
        stale = copy.generate(s.prompts, 10, 0.0, 1.0, [])
        assert [g.token_ids for g in stale] != [g.token_ids for g in moved]
        copy.load_weights(full_state_dict(s.gpt))
        assert [g.token_ids for g in copy.generate(s.prompts, 10, 0.0, 1.0, [])] == [g.token_ids for g in moved]
    finally:
        with torch.no_grad():
            for p in s.gpt.parameters():  # back, exactly: a sign flip
                p.mul_(-1.0)


def test_stop_ids_and_max_new_tokens(setup):
    s = setup
    (free,) = s.engine.generate(s.prompts[:1], 12, 0.0, 1.0, [])
    stop = free.token_ids[4]
    k = free.token_ids.index(stop)
    (g,) = s.engine.generate(s.prompts[:1], 12, 0.0, 1.0, [stop, VOCAB + 7])
    assert g.finished and g.token_ids == free.token_ids[: k + 1]
    assert g.logprobs == pytest.approx(free.logprobs[: k + 1], abs=LP_TOL, rel=LP_RTOL)
    (short,) = s.engine.generate(s.prompts[:1], 3, 0.0, 1.0, [])
    assert not short.finished and short.token_ids == free.token_ids[:3]
    # one row stops early: the others decode on as before
    frees = s.engine.generate(s.prompts, 12, 0.0, 1.0, [])
    mixed = s.engine.generate(s.prompts, 12, 0.0, 1.0, [stop])
    for f, m in zip(frees, mixed):
        n = f.token_ids.index(stop) + 1 if stop in f.token_ids else len(f.token_ids)
        assert m.token_ids == f.token_ids[:n] and m.finished == (stop in f.token_ids)
    assert mixed[0].finished and any(not m.finished for m in mixed)
    assert s.engine.generate([], 5, 0.0, 1.0, []) == []


def test_sampling_is_seeded_nucleus_with_logprobs_at_the_temperature(setup):
    s = setup
    temperature, top_p = 0.7, 0.8
    runs = [
        decoding_as(MegatronEngine(s.gpt, s.policy.device, seed=11), s).generate(s.prompts, 10, temperature, top_p, [])
        for _ in range(2)
    ]
    other = decoding_as(MegatronEngine(s.gpt, s.policy.device, seed=12), s).generate(
        s.prompts, 10, temperature, top_p, []
    )
    assert [g.token_ids for g in runs[0]] == [g.token_ids for g in runs[1]]
    assert [g.token_ids for g in runs[0]] != [g.token_ids for g in other]
    gens = runs[0]
    assert_logprobs(s.gpt, s.prompts, gens, temperature)
    with torch.no_grad():  # every sampled token is inside its step's nucleus
        for p, g in zip(s.prompts, gens):
            seq = p + g.token_ids
            dev = s.policy.device
            ids, pos = torch.tensor([seq], device=dev), torch.arange(len(seq), device=dev)[None]
            logits = s.gpt(ids, pos, None)[0, len(p) - 1 : -1]
            probs = torch.softmax(logits / temperature, -1)
            for probs_V, t in zip(probs, g.token_ids):
                assert float(probs_V[probs_V > probs_V[t]].sum()) < top_p


def test_generation_restores_the_model(setup):
    s = setup
    attentions = [type(layer.self_attention.core_attention) for layer in s.gpt.decoder.layers]
    s.gpt.train()
    s.engine.generate(s.prompts, 4, 1.0, 1.0, [])
    assert s.gpt.training and all(m.training for m in s.gpt.modules())
    s.gpt.eval()
    s.engine.generate(s.prompts, 4, 1.0, 1.0, [])
    assert not any(m.training for m in s.gpt.modules())
    assert [type(layer.self_attention.core_attention) for layer in s.gpt.decoder.layers] == attentions
    assert all(p.grad is None for p in s.gpt.parameters())


@pytest.mark.parametrize("decode", DECODES)
def test_outputs_follow_the_weights_after_an_optimizer_step(decode):
    """The engine reads the parameters in place: after a step its next call (a replayed CUDA graph too)
    decodes with the new weights."""
    cfg, policy = new_policy()
    gpt, prompts = policy.module, make_prompts(seed=5)
    engine = MegatronEngine(gpt, policy.device)
    engine.decode = decode
    old = engine.generate(prompts, 8, 0.0, 1.0, [])
    # one SFT step towards other continuations, at a learning rate that moves the greedy choices
    targets = [[(t + 1) % VOCAB for t in g.token_ids] for g in old]
    batch = [traj(ids=p + t, mask=[0] * len(p) + [1] * len(t)) for p, t in zip(prompts, targets)]
    set_lr(policy.optimizer, 3e-2)
    train_step(policy, pack(batch, capacity=4096), warm_start_loss_fn)
    engine.load_weights({})  # nothing to load: the engine reads the updated parameters
    new = engine.generate(prompts, 8, 0.0, 1.0, [])
    for p, g in zip(prompts, new):
        assert g.token_ids == uncached_greedy(gpt, p, 8)
    assert_logprobs(gpt, prompts, new)
    assert [g.token_ids for g in new] != [g.token_ids for g in old]


def test_grouped_query_heads_equal_uncached_reference():
    """Two query heads a key-value head (Qwen3-8B has four): every way of decoding equals a full forward."""
    cfg, policy = new_policy(("model.num_query_groups=2",))
    gpt, prompts = policy.module, make_prompts(seed=2)
    for decode in DECODES:
        engine = MegatronEngine(gpt, policy.device)
        engine.decode = decode
        gens = engine.generate(prompts, 9, 0.0, 1.0, [])
        for p, g in zip(prompts, gens):
            assert g.token_ids == uncached_greedy(gpt, p, 9), decode
        assert_logprobs(gpt, prompts, gens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_each_key_value_head_once(dtype):
    """A group's query heads as one call's query positions equals SDPA with the keys and values repeated
    per query head; positions after a row's own do not count (stale keys and values there, finite as every
    key the model writes, change nothing)."""
    g = torch.Generator().manual_seed(0)
    N, Hq, Hkv, D, R, L = 5, 8, 2, 16, 7, 40
    q = torch.randn(N, Hq, D, generator=g).to(dtype)
    k, v = (torch.randn(R, L, Hkv, D, generator=g).to(dtype) for _ in range(2))
    pos = torch.tensor([0, 3, 17, 29, 11])
    length = 32
    got = decode_attention(q, k, v, decode_mask(pos, length), scale=0.3)
    ref = []
    for n in range(N):
        kn = k[n, : pos[n] + 1].transpose(0, 1).repeat_interleave(Hq // Hkv, 0)  # [Hq, pos+1, D]
        vn = v[n, : pos[n] + 1].transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        attn = torch.softmax((q[n, :, None].float() @ kn.float().transpose(1, 2)) * 0.3, -1)
        ref.append((attn @ vn.float()).reshape(-1))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), torch.stack(ref), **tol)
    k[torch.arange(N), pos + 1] = v[torch.arange(N), pos + 1] = 1e4  # the next position of every row
    torch.testing.assert_close(decode_attention(q, k, v, decode_mask(pos, length), scale=0.3), got, atol=0, rtol=0)


def test_the_cache_keeps_the_live_rows_in_front_in_place():
    """``_KVCache.keep``: the live rows move to the front, in order, in the same buffers; rows already in place are
    not written (a prefix of live rows copies nothing)."""
    from nemo_orchestra.rollout.engines.megatron import _KVCache

    cache = _KVCache(2, rows=5, length=3)
    rows = torch.arange(5.0)[:, None, None, None].expand(5, 3, 1, 2)
    cache.layers = [(rows.clone(), rows.clone()), None]
    k = cache.layers[0][0]
    pointer = k.data_ptr()
    cache.keep([0, 2, 4])
    assert k[:3, 0, 0, 0].tolist() == [0.0, 2.0, 4.0] and k.data_ptr() == pointer
    k[3:] = -1.0  # rows no sequence holds
    cache.keep([0, 1])  # already in front: nothing moves
    assert k[:, 0, 0, 0].tolist() == [0.0, 2.0, 4.0, -1.0, -1.0]
    cache.keep([1, 2])
    assert k[:2, 0, 0, 0].tolist() == [2.0, 4.0] and torch.equal(cache.layers[0][1][:2], k[:2])


def test_padded_shapes():
    assert [padded_rows(n, 128) for n in (1, 2, 3, 5, 8, 9, 16, 17, 100, 128)] == [1, 2, 4, 8, 8, 16, 16, 32, 112, 128]
    assert padded_rows(100, 104) == 104 and padded_rows(3, 2) == 2
    assert [padded_length(n, 1000) for n in (1, 256, 257, 999)] == [256, 256, 512, 1000]


@pytest.mark.parametrize("decode, sync_every", [("static", 1), ("static", 5), ("dynamic", 3)])
def test_static_steps_and_blocks_decode_as_dynamic_steps_one_by_one(decode, sync_every):
    """Static steps (padded rows and cache length, the cache kept between calls) and tokens copied to the
    host in blocks of steps, against dynamic steps copied one by one: the same tokens, greedy and seeded
    sampling, with rows stopping at different steps (inside a block too); a static engine's smaller call keeps
    the cache, a larger one makes a larger one."""
    cfg, policy = new_policy()
    gpt = policy.module
    dynamic, static = MegatronEngine(gpt, policy.device, seed=3), MegatronEngine(gpt, policy.device, seed=3)
    dynamic.decode, dynamic.sync_every = "dynamic", 1
    static.decode, static.sync_every = decode, sync_every
    prompts = make_prompts(seed=4)
    (probe,) = dynamic.generate(prompts[:1], 16, 0.0, 1.0, [])
    stops = probe.token_ids[3:12:4]  # the first row stops at its 4th token, the others where they meet one
    calls = [
        (prompts, 16, 0.0, 1.0, stops, None),
        (prompts[1:3], 12, 0.8, 0.9, stops, [5, 6]),  # fewer rows, shorter: the cache is kept
        (prompts * 3, 300, 0.8, 0.9, stops, list(range(12))),  # more rows, longer: a new one
        (prompts[2:] + prompts[:1], 20, 0.0, 1.0, [], None),
    ]
    caches, released = [], []
    for prompts_, n, temperature, top_p, stop_ids, seeds in calls:
        held = weakref.ref(static._static) if static._static is not None else None
        a = dynamic.generate(prompts_, n, temperature, top_p, stop_ids, seeds=seeds)
        b = static.generate(prompts_, n, temperature, top_p, stop_ids, seeds=seeds)
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
        assert [g.finished for g in a] == [g.finished for g in b]
        for x, y in zip(a, b):
            assert x.logprobs == pytest.approx(y.logprobs, abs=LP_TOL, rel=LP_RTOL)
        caches.append(static._static.cache if decode == "static" else None)
        released.append(held is not None and held() is None)
    ends = [len(g.token_ids) for g in static.generate(prompts, 16, 0.0, 1.0, stops)]
    assert len(set(ends)) > 1  # rows left the decode at different steps
    assert sync_every == 1 or any(n % sync_every for n in ends)  # and inside a block
    if decode == "static":
        assert caches[1] is caches[0] and caches[2] is not caches[1] and caches[3] is caches[2]
        assert caches[0].rows == 4 and caches[2].rows == 16 and caches[2].length >= 30 + 300
        assert released == [False, False, True, False]  # the smaller cache went when the larger one came
        held = weakref.ref(static._static)
        static.close()
        assert held() is None


def test_engine_is_registered_and_needs_the_model(setup):
    s = setup
    assert capabilities("megatron").reads_policy_weights and isinstance(s.engine, MegatronEngine)
    assert isinstance(s.engine, GenerationEngine) and s.engine.capabilities.spans_tensor_parallel_group
    with pytest.raises(ValueError, match="pass model"):
        start_engine("megatron", EngineContext(s.cfg.model, VOCAB, None, s.policy.device))


def test_trainer_pushes_no_weights_into_it(setup, monkeypatch):
    from dataclasses import replace

    import nemo_orchestra.train.trainer as trainer_module
    from nemo_orchestra.train.trainer import Trainer
    from nemo_orchestra.train.rollout_source import on_rollout_rank
    from nemo_orchestra.train.run_plan import RunPlan
    from nemo_orchestra.rollout.managed_engine import ManagedEngine

    def no_gather(gpt):
        raise AssertionError("the megatron engine needs no gathered state dict")

    monkeypatch.setattr(trainer_module, "full_state_dict", no_gather)
    s = setup
    cfg = replace(s.cfg, rollout=replace(s.cfg.rollout, engine="megatron"))

    def no_factory(state):
        raise AssertionError("the megatron engine is built with the policy, not at a weight sync")

    plan = RunPlan.make(cfg, s.policy.device)
    trainer = Trainer(cfg, plan, s.policy, ManagedEngine(no_factory, engine=s.engine), rollouts=None, logger=None)
    trainer.sync_weights(0)
    trainer.sync_weights(1)
    assert trainer.generation.weights.version == 1
    assert trainer.generation.engine is s.engine
    assert on_rollout_rank(trainer.generation, lambda: 42) == 42  # one rank: it is the rollout rank


@pytest.mark.parametrize(
    "layout, message",
    [
        (dict(pipeline_model_parallel_size=2), "does not support pipeline parallelism .*vllm.*hf"),
        (dict(sequence_parallel=True), "does not support parallel.sequence_parallel"),
        (dict(fp8="hybrid"), "does not support model.fp8"),
    ],
    ids=["pp", "sequence_parallel", "fp8"],
)
def test_refused_layouts_name_the_alternatives(layout, message):
    config = dict(pipeline_model_parallel_size=1, sequence_parallel=False, fp8=None, tensor_model_parallel_size=1)
    model = SimpleNamespace(config=SimpleNamespace(**{**config, **layout}))
    with pytest.raises(ValueError, match=f"rollout.engine=megatron {message}"):
        MegatronEngine(model, CPU)


# ---- tensor parallel: 2 gloo ranks ----------------------------------------------------------------------
def _tp_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """TP=1 generation on full weights, then TP=2 on their shards, by the live engine and by the copy
    engine (loaded from the full weights): rank 0 generates from a worker thread (as the rollouts do)
    while rank 1 serves, until rank 0 releases it."""
    import warnings

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from nemo_orchestra.megatron import cpu_compat
    from nemo_orchestra.megatron.model import build_gpt_model
    from nemo_orchestra.megatron.sharding import load_full_state, model_state

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    cpu_compat.install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    prompts = make_prompts()

    def run(engine):
        with ThreadPoolExecutor(max_workers=1) as thread:
            calls = [
                thread.submit(engine.generate, prompts, 10, 0.0, 1.0, []),
                thread.submit(engine.generate, prompts, 10, 1.0, 0.9, []),
            ]
            return [[vars(g) for g in c.result()] for c in calls]

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    cfg = load_config([])
    gpt = build_gpt_model(cfg.model, cfg.parallel, VOCAB, CPU)
    sharpen(gpt)
    full = {k: v.detach().clone() for k, v in model_state(gpt).items()}
    one = run(MegatronEngine(gpt, CPU, seed=3))

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = load_config(["parallel.tp=2"])
    gpt = build_gpt_model(cfg.model, cfg.parallel, VOCAB, CPU, initialize=False)
    load_full_state(gpt, full.__getitem__, list(full))
    engine = MegatronEngine(gpt, CPU, seed=3)
    copy = MegatronCopyEngine.create(EngineContext(cfg.model, VOCAB, None, CPU, seed=3, parallel=cfg.parallel), full)
    if rank == 0:
        two = run(engine)
        engine.release()
        two_copy = run(copy)
        copy.release()
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump({"tp1": one, "tp2": two, "tp2_copy": two_copy}, f)
    else:
        engine.serve()
        copy.serve()
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_tp2_generates_what_tp1_does_live_and_on_a_copy(monkeypatch):
    import torch.multiprocessing as mp

    from nemo_orchestra.megatron.parallel import _free_port

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # two gloo ranks on the CPU, also on a GPU machine
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_tp_rank, args=(2, _free_port(), out_dir), nprocs=2, join=True)
        with open(os.path.join(out_dir, "results.json")) as f:
            r = json.load(f)
    for tp1, tp2, tp2_copy in zip(r["tp1"], r["tp2"], r["tp2_copy"]):  # greedy, then sampled with the same seed
        for a, b in zip(tp2, tp2_copy):  # the copy engine, its shards loaded from the full weights, as the live one
            assert a["token_ids"] == b["token_ids"] and a["finished"] == b["finished"]
            assert a["logprobs"] == b["logprobs"]
        for a, b in zip(tp1, tp2):
            assert a["token_ids"] == b["token_ids"] and a["finished"] == b["finished"]
            assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
