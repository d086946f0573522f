"""First-fit-decreasing packing of trajectories into THD microbatches of at most N tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nemo_orchestra.types import PackedBatch, Trajectory

PAD_SEQUENCE = 256  # longest padding sequence


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices; each bin's total length <= capacity (a longer item gets a bin alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack(
    trajectories: Sequence[Trajectory], capacity: int, pad_to_multiple: int = 1, pad_to_length: int | None = None
) -> list[PackedBatch]:
    """Pack rollouts into microbatches. ``pad_to_multiple`` pads each pack (TP needs T % tp == 0);
    ``pad_to_length`` pads every pack to at least that many tokens (PP needs one shape)."""
    bins = first_fit_decreasing([len(t.token_ids) for t in trajectories], capacity)
    return [_pack_one([trajectories[i] for i in b], b, pad_to_multiple, pad_to_length) for b in bins]


def _pack_one(
    trajs: Sequence[Trajectory], index: list[int], pad_to_multiple: int, pad_to_length: int | None = None
) -> PackedBatch:
    ids, pos, tgt, mask, adv, gen, les, cu = [], [], [], [], [], [], [], [0]
    for t in trajs:
        n = len(t.token_ids)
        ids += t.token_ids
        pos += range(n)
        tgt += t.token_ids[1:] + [0]
        # loss_mask[i] marks token i as generated; as a *target* it is predicted at position i-1.
        mask += t.loss_mask[1:] + [0]
        gen += t.gen_logprobs[1:] + [0.0]  # shifted like the mask: the logprob of each target
        adv += [t.advantage] * n
        les += [float(bool(t.meta.get("lesson")))] * n
        cu.append(cu[-1] + n)
    pad = max(pad_to_length or 0, len(ids)) - len(ids)
    pad += (-(len(ids) + pad)) % pad_to_multiple
    index = list(index)
    while pad:  # padding "sequences" with no loss, short so that their attention costs little
        n = min(pad, PAD_SEQUENCE)
        ids += [0] * n
        pos += range(n)
        tgt += [0] * n
        mask += [0] * n
        gen += [0.0] * n
        adv += [0.0] * n
        les += [0.0] * n
        cu.append(cu[-1] + n)
        index.append(-1)
        pad -= n
    T = len(ids)
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    return PackedBatch(
        input_ids_T=torch.tensor(ids, dtype=torch.long),
        position_ids_T=torch.tensor(pos, dtype=torch.long),
        target_ids_T=torch.tensor(tgt, dtype=torch.long),
        loss_mask_T=torch.tensor(mask, dtype=torch.float32),
        advantages_T=torch.tensor(adv, dtype=torch.float32),
        old_logprobs_T=None,
        ref_logprobs_T=torch.zeros(T),
        cu_seqlens_B1=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(lens) if lens else 0,
        traj_index_B=list(index),
        gen_logprobs_T=torch.tensor(gen, dtype=torch.float32),
        lesson_T=torch.tensor(les, dtype=torch.float32),
    )


def padding_pack(length: int, multiple: int = 1) -> PackedBatch:
    T = -(-length // multiple) * multiple
    zeros = torch.zeros(T, dtype=torch.long)
    return PackedBatch(
        input_ids_T=zeros,
        position_ids_T=torch.arange(T),
        target_ids_T=zeros,
        loss_mask_T=torch.zeros(T),
        advantages_T=torch.zeros(T),
        old_logprobs_T=torch.zeros(T),
        ref_logprobs_T=torch.zeros(T),
        cu_seqlens_B1=torch.tensor([0, T], dtype=torch.int32),
        max_seqlen=T,
        traj_index_B=[-1],
        gen_logprobs_T=torch.zeros(T),
        lesson_T=torch.zeros(T),
    )
