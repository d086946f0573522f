"""Grouped advantages: hand-computed values, Triton kernel vs reference on ragged groups, edge cases."""

import importlib
import math

import pytest
import torch

from nemo_orchestra.grpo.advantages import assign_advantages
from tests.helpers import adv_cfg, traj

from nemo_orchestra import kernels
from nemo_orchestra.kernels.reference import grouped_advantage_ref

# The module, not the op of the same name that ``kernels`` exports.
grouped_advantage_module = importlib.import_module("nemo_orchestra.kernels.grouped_advantage")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = ["mean", "std", "loo"]

# Groups [1, 0, 1, 1] | [5] | [2, 2, 2] | [0, 1]
REWARDS = [1.0, 0.0, 1.0, 1.0, 5.0, 2.0, 2.0, 2.0, 0.0, 1.0]
OFFSETS = [0, 4, 5, 8, 10]
S = 1 / math.sqrt(0.5)  # group [0, 1]: mean 0.5, sample std sqrt(0.5)
HAND = {
    # group 1: mean 0.75; sample std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5
    "mean": [0.25, -0.75, 0.25, 0.25, 0.0, 0.0, 0.0, 0.0, -0.5, 0.5],
    "std": [0.5, -1.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, -0.5 * S, 0.5 * S],
    "loo": [1 / 3, -1.0, 1 / 3, 1 / 3, 0.0, 0.0, 0.0, 0.0, -1.0, 1.0],  # r_i - mean of the others
}


def ops():
    return {"kernel": kernels.grouped_advantage, "reference": grouped_advantage_ref}


@pytest.mark.parametrize("op", ["kernel", "reference"])
@pytest.mark.parametrize("mode", MODES)
def test_hand_computed(op, mode):
    rewards = torch.tensor(REWARDS, device=DEVICE)
    got = ops()[op](rewards, offsets=torch.tensor(OFFSETS, device=DEVICE), mode=mode)
    torch.testing.assert_close(got.cpu(), torch.tensor(HAND[mode]), atol=1e-5, rtol=1e-5)
    ids = torch.tensor([7, 7, 7, 7, -2, 40, 40, 40, 3, 3], device=DEVICE)
    perm = torch.tensor([9, 0, 4, 2, 5, 8, 1, 7, 3, 6])
    got = ops()[op](rewards[perm.to(DEVICE)], group_ids=ids[perm.to(DEVICE)], mode=mode)
    torch.testing.assert_close(got.cpu(), torch.tensor(HAND[mode])[perm], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", ["kernel", "reference"])
def test_clip_is_symmetric(op):
    rewards = torch.tensor(REWARDS, device=DEVICE)
    got = ops()[op](rewards, offsets=torch.tensor(OFFSETS, device=DEVICE), mode="std", clip=1.0)
    want = torch.tensor(HAND["std"]).clamp(-1.0, 1.0)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", ["kernel", "reference"])
@pytest.mark.parametrize("mode", MODES)
def test_singletons_and_equal_groups_are_exactly_zero(op, mode):
    """In fp32, sum([0.9] * 3) / 3 != 0.9 and sum([0.1] * 7) / 7 != 0.1: a naive mean leaves an ulp
    of deviation (which eps=0 would blow up to +-1); the mean around a group member is exact."""
    rewards = torch.tensor([0.9] * 3 + [0.3, 7.0] + [0.1] * 7, device=DEVICE)
    offsets = torch.tensor([0, 3, 4, 5, 12], device=DEVICE)
    for kwargs in ({"offsets": offsets}, {"group_ids": torch.repeat_interleave(torch.arange(4), offsets.diff().cpu())}):
        kwargs = {k: v.to(DEVICE) for k, v in kwargs.items()}
        got = ops()[op](rewards, mode=mode, eps=0.0, **kwargs)
        assert got.cpu().tolist() == [0.0] * 12


def random_groups(seed, n_groups=12, max_size=12):
    """Ragged groups (sizes 0..max_size, one of size 1, one all-equal): rewards and offsets, and the
    same rewards shuffled by ``perm`` with their group ids (arbitrary integers)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, max_size + 1, (n_groups,), generator=g)
    sizes[0], sizes[1] = 1, max(int(sizes[1]), 2)
    offsets = torch.nn.functional.pad(sizes.cumsum(0), (1, 0))
    rewards = torch.randint(0, 5, (int(offsets[-1]),), generator=g).float() * 0.25 + torch.rand(1, generator=g)
    rewards[offsets[1] : offsets[2]] = 0.3  # all equal
    ids = torch.repeat_interleave(torch.randperm(n_groups, generator=g) * 5 - 17, sizes)
    perm = torch.randperm(rewards.numel(), generator=g)
    return rewards, offsets, rewards[perm], ids[perm], perm


TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("clip", [None, 1.5], ids=["noclip", "clip"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1], ids=lambda s: f"seed{s}")
def test_kernel_matches_reference(seed, mode, clip, dtype):
    rewards, offsets, shuffled, ids, _ = (x.to(DEVICE) for x in random_groups(seed))
    rewards, shuffled = rewards.to(dtype), shuffled.to(dtype)
    for kwargs, r in (({"offsets": offsets}, rewards), ({"group_ids": ids}, shuffled)):
        got = kernels.grouped_advantage(r, mode=mode, clip=clip, **kwargs)
        want = grouped_advantage_ref(r, mode=mode, clip=clip, **kwargs)
        assert got.dtype == dtype and not got.isnan().any()
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_ids_and_offsets_forms_agree():
    rewards, offsets, shuffled, ids, perm = random_groups(seed=3)
    for op in ops().values():
        by_offsets = op(rewards.to(DEVICE), offsets=offsets.to(DEVICE))
        by_ids = op(shuffled.to(DEVICE), group_ids=ids.to(DEVICE))
        torch.testing.assert_close(by_ids, by_offsets[perm.to(DEVICE)], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_large_groups_walk_in_chunks(monkeypatch, mode):
    monkeypatch.setattr(grouped_advantage_module, "MAX_BLOCK_N", 16)  # groups of up to 70 -> 5 chunks
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(100, generator=g).to(DEVICE)
    offsets = torch.tensor([0, 1, 30, 30, 100], device=DEVICE)
    got = kernels.grouped_advantage(rewards, offsets=offsets, mode=mode, clip=2.0)
    torch.testing.assert_close(
        got, grouped_advantage_ref(rewards, offsets=offsets, mode=mode, clip=2.0), atol=1e-5, rtol=1e-5
    )


def test_poisoned_memory():
    """Rewards padded with NaN; advantages written into a view of a NaN buffer, margins untouched."""
    rewards, offsets, *_ = random_groups(seed=5)
    N, pad = rewards.numel(), 5
    r_buf = torch.full((N + 2 * pad,), float("nan"), device=DEVICE)
    r_buf[pad : pad + N] = rewards
    out_buf = torch.full((N + 2 * pad,), float("nan"), device=DEVICE)
    sizes = offsets[1:] - offsets[:-1]
    grouped_advantage_module.grouped_advantage_launch(
        r_buf[pad : pad + N], offsets.to(DEVICE), int(sizes.max()), "std", 1e-6, None, out=out_buf[pad : pad + N]
    )
    assert out_buf[:pad].isnan().all() and out_buf[pad + N :].isnan().all()
    torch.testing.assert_close(
        out_buf[pad : pad + N].cpu(), grouped_advantage_ref(rewards, offsets=offsets), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("op", ["kernel", "reference"])
def test_empty(op):
    empty = torch.empty(0, device=DEVICE)
    assert ops()[op](empty, offsets=torch.zeros(1, dtype=torch.int64, device=DEVICE)).shape == (0,)
    assert ops()[op](empty, group_ids=torch.empty(0, dtype=torch.int64, device=DEVICE)).shape == (0,)


BAD = {
    "both forms": (dict(group_ids=torch.zeros(3, dtype=torch.int64), offsets=torch.tensor([0, 3])), "exactly one"),
    "neither form": (dict(), "exactly one"),
    "mode": (dict(offsets=torch.tensor([0, 3]), mode="zscore"), "mode must be one of"),
    "eps": (dict(offsets=torch.tensor([0, 3]), eps=-1.0), "eps must be >= 0"),
    "clip": (dict(offsets=torch.tensor([0, 3]), clip=0.0), "clip must be None or > 0"),
    "offsets end": (dict(offsets=torch.tensor([0, 2])), "end at N=3"),
    "offsets start": (dict(offsets=torch.tensor([1, 3])), "start at 0"),
    "offsets decreasing": (dict(offsets=torch.tensor([0, 2, 1, 3])), "non-decreasing"),
    "float offsets": (dict(offsets=torch.tensor([0.0, 3.0])), "int32 or int64"),
    "ids length": (dict(group_ids=torch.zeros(2, dtype=torch.int64)), "one id per reward \\(3\\)"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("op", ["kernel", "reference"])
def test_validation_errors(op, case):
    kwargs, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        ops()[op](torch.tensor([1.0, 2.0, 3.0]), **kwargs)


@pytest.mark.parametrize("rewards", [torch.tensor([[1.0]]), torch.tensor([1, 2])], ids=["2-D", "int"])
def test_rewards_must_be_1d_float(rewards):
    with pytest.raises(ValueError, match="1-D floating-point"):
        kernels.grouped_advantage(rewards, offsets=torch.tensor([0, rewards.numel()]))


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["offsets", "ids"])
def test_gpu_million_rewards(form):
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = torch.randint(1, 33, (60_000,), device="cuda", generator=g)
    offsets = torch.nn.functional.pad(sizes.cumsum(0), (1, 0))
    rewards = torch.rand(int(offsets[-1]), device="cuda", generator=g)
    if form == "offsets":
        kwargs = {"offsets": offsets}
    else:
        kwargs = {"group_ids": torch.repeat_interleave(torch.arange(60_000, device="cuda"), sizes)}
    got = kernels.grouped_advantage(rewards, mode="std", clip=3.0, **kwargs)
    torch.testing.assert_close(
        got, grouped_advantage_ref(rewards, mode="std", clip=3.0, **kwargs), atol=1e-4, rtol=1e-4
    )


def test_training_path_runs_the_advantage_kernel(monkeypatch):
    """The trainer's advantages (``assign_advantages`` on the training device) are the Triton kernel's
    where the kernel runs (CUDA, or the interpreter on CPU), and equal the reference's."""
    import nemo_orchestra.kernels.grouped_advantage as kmod

    cfg = adv_cfg()
    rewards = [0.3, 1.0, 0.0, 0.7, 0.7, 0.7, 0.2, 0.9, 0.4]
    groups = [2, 0, 2, 1, 1, 1, 0, 0, 2]  # unsorted, one all-equal group
    ref = [traj(group=g) for g in groups]
    for t, r in zip(ref, rewards):
        t.reward = r
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch reference
    kept_ref, m_ref = assign_advantages(ref, cfg)
    launches = []
    launch = kmod.grouped_advantage_launch
    monkeypatch.setattr(kmod, "grouped_advantage_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ker = [traj(group=g) for g in groups]
    for t, r in zip(ker, rewards):
        t.reward = r
    kept_ker, m_ker = assign_advantages(ker, cfg, torch.device(DEVICE))
    assert launches, "the Triton kernel did not run"
    assert [t.advantage for t in ker] == pytest.approx([t.advantage for t in ref], abs=1e-5)
    assert [t.group for t in kept_ker] == [t.group for t in kept_ref] and 1 not in {t.group for t in kept_ker}
    assert m_ker["advantage/groups_dropped"] == m_ref["advantage/groups_dropped"] == 1
