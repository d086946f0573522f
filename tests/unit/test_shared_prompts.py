"""A group's common prompt packed once (``perf.share_prompts``, ``train/packing.py``): the layout, and
logprobs and gradients equal to packing every trajectory whole."""

import pytest
import torch

from nemo_orchestra.kernels.reference import prefix_attention_ref, varlen_attention_ref
from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.megatron.forward import forward_logprobs, loss_rows, packed_forward, scatter_rows, token_logprobs
from nemo_orchestra.megatron.model import build_gpt_model
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.train.flops import forward_flops, sequence_lengths
from nemo_orchestra.train.packing import PADDING, SHARED_PROMPT, pack
from tests.helpers import traj

VOCAB = 256


def group_of(prompt: list[int], n: int, seed: int, advantage=None, turns: int = 2) -> list:
    """``n`` rollouts of one prompt: generated turns and observations of varying lengths after it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        ids, mask = list(prompt), [0] * len(prompt)
        for turn in range(turns):
            gen = torch.randint(2, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            ids += gen
            mask += [1] * len(gen)
            if turn < turns - 1:
                obs = torch.randint(2, VOCAB, (5,), generator=g).tolist()
                ids += obs
                mask += [0] * len(obs)
        t = traj(ids=ids, mask=mask)
        t.advantage = float(advantage[k]) if advantage is not None else float(k) - (n - 1) / 2
        out.append(t)
    return out


def batch_of_groups() -> list:
    g = torch.Generator().manual_seed(0)
    p1 = torch.randint(2, VOCAB, (40,), generator=g).tolist()
    p2 = torch.randint(2, VOCAB, (25,), generator=g).tolist()
    short = torch.randint(2, VOCAB, (6,), generator=g).tolist()  # shorter than MIN_SHARED: never shared
    return group_of(p1, 4, 1) + group_of(p2, 3, 2) + group_of(short, 2, 3) + group_of(p1[:30], 1, 4)


def per_trajectory(batch, values_T: torch.Tensor, trajs) -> list[torch.Tensor]:
    """The pack's per-position values back on each trajectory's positions; a shared prompt's positions
    stay NaN (they belong to no one trajectory)."""
    cu = batch.cu_seqlens_B1.tolist()
    prefix = batch.prefix_B or [-1] * (len(cu) - 1)
    out = [torch.full((len(t.token_ids),), float("nan")) for t in trajs]
    for j, i in enumerate(batch.traj_index_B):
        if i < 0:
            continue
        start = cu[prefix[j] + 1] - cu[prefix[j]] if prefix[j] >= 0 else 0
        out[i][start:] = values_T[cu[j] : cu[j + 1]]
    return out


def test_a_group_prompt_is_packed_once_and_each_trajectory_reads_back_whole():
    trajs = batch_of_groups()
    (batch,) = pack(trajs, capacity=4096, share_prompts=True)
    cu = batch.cu_seqlens_B1.tolist()
    ids = batch.input_ids_T.tolist()
    shared = [j for j, i in enumerate(batch.traj_index_B) if i == SHARED_PROMPT]
    assert len(shared) == 2  # the 4- and 3-rollout groups; the short prompt and the lone rollout are whole
    for j, i in enumerate(batch.traj_index_B):
        if i < 0:
            continue
        p = batch.prefix_B[j]
        head = ids[cu[p] : cu[p + 1]] if p >= 0 else []
        assert head + ids[cu[j] : cu[j + 1]] == trajs[i].token_ids
        pos = batch.position_ids_T[cu[j] : cu[j + 1]].tolist()
        assert pos == list(range(len(head), len(trajs[i].token_ids)))
        if p >= 0:  # the prompt ends one token before the first generated one: its logits predict it
            assert len(head) == trajs[i].loss_mask.index(1) - 1
    for j in shared:
        assert (
            batch.loss_mask_T[cu[j] : cu[j + 1]].sum() == 0 and batch.advantages_T[cu[j] : cu[j + 1]].abs().sum() == 0
        )
    (whole,) = pack(trajs, capacity=4096)
    assert whole.prefix_B is None
    assert batch.num_tokens == whole.num_tokens - (4 - 1) * 39 - (3 - 1) * 24
    for name in ("loss_mask_T", "target_ids_T", "advantages_T", "gen_logprobs_T"):
        a, b = (
            per_trajectory(batch, getattr(batch, name).float(), trajs),
            per_trajectory(whole, getattr(whole, name).float(), trajs),
        )
        for x, y in zip(a, b):
            own = ~x.isnan()
            torch.testing.assert_close(x[own], y[own])
            assert y[~own].isnan().sum() == 0 and (name != "loss_mask_T" or y[~own].sum() == 0)


def test_a_group_larger_than_a_pack_is_split_and_each_part_carries_the_prompt():
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, VOCAB, (40,), generator=g).tolist()
    trajs = group_of(prompt, 6, 7)
    longest = max(len(t.token_ids) for t in trajs)
    capacity = 40 + 2 * (longest - 39)  # room for the prompt and two continuations
    batches = pack(trajs, capacity=capacity, share_prompts=True)
    assert all(b.num_tokens <= capacity for b in batches) and len(batches) >= 3
    seen = sorted(i for b in batches for i in b.traj_index_B if i >= 0)
    assert seen == list(range(6))
    assert all(SHARED_PROMPT in b.traj_index_B for b in batches)


def test_padding_and_sequence_lengths_for_flops():
    trajs = batch_of_groups()
    (batch,) = pack(trajs, capacity=4096, pad_to_multiple=64, share_prompts=True)
    assert batch.num_tokens % 64 == 0 and batch.traj_index_B[-1] == PADDING
    lens, prefixes = sequence_lengths([batch])
    cu = batch.cu_seqlens_B1.tolist()
    assert sum(lens) == cu[-1] - sum(
        n for n, i in zip([b - a for a, b in zip(cu[:-1], cu[1:])], batch.traj_index_B) if i == PADDING
    )
    assert sorted(set(prefixes)) == [0, 24, 39]
    # without sharing the same trajectories count more FLOPs: every prompt again, and its attention
    cfg = load_config([])
    (whole,) = pack(trajs, capacity=4096)
    wl, wp = sequence_lengths([whole])
    assert set(wp) == {0}
    assert forward_flops(cfg.model, VOCAB, lens, 0, prefixes) < forward_flops(cfg.model, VOCAB, wl, 0, wp)


def test_prefix_attention_equals_attention_over_the_whole_sequences():
    torch.manual_seed(0)
    Hq, Hkv, D, P = 4, 2, 16, 9
    lens = [P, 5, 7, 3, 6]  # a prompt, two continuations, a sequence of its own, a third continuation
    prefix = [-1, 0, 0, -1, 0]
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, requires_grad=True) for h in (Hq, Hkv, Hkv))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = prefix_attention_ref(q, k, v, cu, prefix, softmax_scale=0.3)
    # the same continuations with the prompt written in front of each
    segs = [slice(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    whole = [torch.cat([x[segs[0]], x[segs[j]]]) for j in (1, 2) for x in (q, k, v)]
    whole += [x[segs[3]] for x in (q, k, v)] + [torch.cat([x[segs[0]], x[segs[4]]]) for x in (q, k, v)]
    wq, wk, wv = (torch.cat(whole[i::3]) for i in range(3))
    wlens = [P + 5, P + 7, 3, P + 6]
    wcu = torch.tensor([0] + torch.tensor(wlens).cumsum(0).tolist(), dtype=torch.int32)
    ref, _ = varlen_attention_ref(wq, wk, wv, wcu, max(wlens), softmax_scale=0.3, return_lse=False)
    r = ref.split(wlens)
    torch.testing.assert_close(out[segs[0]], r[0][:P])  # the prompt itself: as at the head of any of them
    torch.testing.assert_close(out[segs[1]], r[0][P:])
    torch.testing.assert_close(out[segs[2]], r[1][P:])
    torch.testing.assert_close(out[segs[3]], r[2])
    torch.testing.assert_close(out[segs[4]], r[3][P:])
    # gradients: the prompt's keys and values collect every continuation's
    w = torch.randn_like(out)
    gq, gk, gv = torch.autograd.grad((out * w).sum(), (q, k, v))
    wsel = torch.cat([w[segs[1]], w[segs[2]], w[segs[3]], w[segs[4]]])
    wmask = torch.cat(
        [torch.zeros(P), torch.ones(5), torch.zeros(P), torch.ones(7), torch.ones(3), torch.zeros(P), torch.ones(6)]
    )
    wfull = torch.zeros_like(ref)
    wfull[wmask > 0] = wsel
    wfull[:P] = w[segs[0]]  # the prompt's own outputs, counted once (in the first copy)
    hq, hk, hv = torch.autograd.grad((ref * wfull).sum(), (wq, wk, wv))
    for got, want in ((gq, hq), (gk, hk), (gv, hv)):
        back = torch.zeros_like(got)
        offs = [0, P + 5, 2 * P + 12, 2 * P + 15]
        back[segs[0]] += want[0:P] + want[offs[1] : offs[1] + P] + want[offs[3] : offs[3] + P]
        back[segs[1]] += want[P : P + 5]
        back[segs[2]] += want[offs[1] + P : offs[2]]
        back[segs[3]] += want[offs[2] : offs[3]]
        back[segs[4]] += want[offs[3] + P :]
        torch.testing.assert_close(got, back)


def test_a_prefix_must_be_a_sequence_without_one():
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="sequence 2: prefix 1"):
        prefix_attention_ref(q, q, q, cu, [-1, 0, 1])
    with pytest.raises(ValueError, match="one prefix per sequence"):
        prefix_attention_ref(q, q, q, cu, [-1, 0])


@pytest.fixture(scope="module")
def model():
    # torch attention on every device (auto without CUDA): whole packs and shared ones in fp32 alike, where
    # on CUDA the Triton kernel would take the whole packs in tf32 and the shared ones go to the reference
    cfg = load_config(["model.num_layers=2", "model.attention_backend=torch"])
    info = init_distributed(cfg.parallel, seed=3)
    torch.manual_seed(0)
    return build_gpt_model(cfg.model, cfg.parallel, VOCAB, info.device)


def test_logprobs_with_shared_prompts_equal_whole_trajectories(model):
    trajs = batch_of_groups()
    (shared,) = pack(trajs, capacity=4096, share_prompts=True)
    (whole,) = pack(trajs, capacity=4096)
    for only in (False, True):
        dev = next(model.parameters()).device  # where init_distributed put it: the GPU where there is one
        a = per_trajectory(shared, forward_logprobs(model, shared, dev, 0.7, only_loss_tokens=only), trajs)
        b = per_trajectory(whole, forward_logprobs(model, whole, dev, 0.7, only_loss_tokens=only), trajs)
        for t, x, y in zip(trajs, a, b):
            trained = torch.tensor(t.loss_mask[1:] + [0]) > 0  # positions whose target was generated
            torch.testing.assert_close(x[trained], y[trained], atol=1e-5, rtol=1e-5)
            assert trained.any()


def _grads(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    dev = next(model.parameters()).device
    rows = loss_rows(batch, dev)
    target = batch.target_ids_T.to(dev)[rows]
    lp = scatter_rows(token_logprobs(packed_forward(model, batch, dev, rows), target, 0.7), rows, batch.num_tokens)
    (-(lp * batch.loss_mask_T.to(dev) * batch.advantages_T.to(dev)).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradients_with_shared_prompts_equal_whole_trajectories(model):
    """The prompt's activations collect every continuation's gradient: the policy-gradient step is the same."""
    model.train()
    trajs = batch_of_groups()
    (shared,) = pack(trajs, capacity=4096, share_prompts=True)
    (whole,) = pack(trajs, capacity=4096)
    a, b = _grads(model, shared), _grads(model, whole)
    assert set(a) == set(b) and any("embedding" in n for n in a)
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=1e-5, rtol=1e-4, msg=n)
    model.eval()


def test_share_prompts_config():
    # null: on with the torch attention (auto without CUDA), off with triton (auto on CUDA)
    assert load_config([]).share_prompts is not torch.cuda.is_available()
    assert load_config(["model.attention_backend=torch"]).share_prompts
    assert not load_config(["perf.share_prompts=false"]).share_prompts
    assert not load_config(["model.attention_backend=triton"]).share_prompts  # null: off, not measured there
    assert load_config(["model.attention_backend=triton", "perf.share_prompts=true"]).share_prompts
    assert not load_config(["model.attention_backend=te"]).share_prompts  # null: off with TE's
    with pytest.raises(ConfigError, match="perf.share_prompts"):
        load_config(["model.attention_backend=te", "perf.share_prompts=true"])
