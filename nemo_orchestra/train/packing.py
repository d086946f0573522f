"""First-fit-decreasing packing of trajectories into THD microbatches of at most N tokens.

Shared prompts (``share_prompts=True``): the G rollouts of a GRPO group begin with the same prompt
(system prompt, tool schemas, question), most of each trajectory's tokens. Trajectories whose
tokens agree up to their first generated token are packed as one *unit*: the common prompt once,
as a segment of its own, then each trajectory's remainder as a segment that attends to the prompt
segment and to itself, causally (``PackedBatch.prefix_B``). Positions continue across the prompt, so
every token sees exactly the keys and positions it would see alone: logprobs and gradients equal the
per-trajectory packing's (the prompt's activations get the sum of the remainders' gradients), at the
prompt's cost once per unit instead of once per trajectory. The shared part stops one token before the
first generated token, so no loss target falls in it. A unit larger than the capacity is split into
units that each carry the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_orchestra.types import PackedBatch, Trajectory

PAD_SEQUENCE = 256  # longest padding sequence
PADDING = -1  # traj_index_B of a padding segment
SHARED_PROMPT = -2  # traj_index_B of a prompt segment shared by the segments after it
MIN_SHARED = 16  # a shorter common prompt is not worth a segment of its own


@dataclass
class _Unit:
    """Trajectories (indices) packed together; ``shared`` tokens of their common prompt once (0: none)."""

    members: list[int]
    shared: int

    def size(self, lengths: Sequence[int]) -> int:
        return self.shared + sum(lengths[i] - self.shared for i in self.members)


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


def shareable_prompt(t: Trajectory) -> int:
    """Tokens of ``t`` that may be shared with another trajectory: up to one before its first generated
    token or one-token plan (whose logits predict that token), so none of them is a loss target."""
    first = next((i for i, m in enumerate(t.loss_mask) if m), len(t.token_ids))
    return max(min([first, *(k for k, _ in t.plans)]) - 1, 0)


def _units(trajectories: Sequence[Trajectory], capacity: int, share: bool) -> list[_Unit]:
    lengths = [len(t.token_ids) for t in trajectories]
    if not share:
        return [_Unit([i], 0) for i in range(len(trajectories))]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, t in enumerate(trajectories):
        n = shareable_prompt(t)
        key = tuple(t.token_ids[:n]) if n >= MIN_SHARED else (-1 - i,)  # a unique key: not shared
        by_prompt.setdefault(key, []).append(i)
    units = []
    for key, members in by_prompt.items():
        shared = len(key) if len(members) > 1 and key[0] >= 0 else 0
        if not shared:
            units += [_Unit([i], 0) for i in members]
            continue
        members = sorted(members, key=lambda i: -lengths[i])
        unit = _Unit([], shared)
        for i in members:  # split where the unit would outgrow the capacity; each part carries the prompt
            if unit.members and unit.size(lengths) + lengths[i] - shared > capacity:
                units.append(unit)
                unit = _Unit([], shared)
            unit.members.append(i)
        units.append(unit)
    return [u if len(u.members) > 1 else _Unit(u.members, 0) for u in units]


def pack(
    trajectories: Sequence[Trajectory],
    capacity: int,
    pad_to_multiple: int = 1,
    pad_to_length: int | None = None,
    share_prompts: bool = False,
) -> list[PackedBatch]:
    """Pack rollouts into microbatches. ``pad_to_multiple`` pads each pack (TP needs T % tp == 0);
    ``pad_to_length`` pads every pack to at least that many tokens (PP needs one shape);
    ``share_prompts`` packs a common prompt once per unit (module docstring)."""
    lengths = [len(t.token_ids) for t in trajectories]
    units = _units(trajectories, capacity, share_prompts)
    bins = first_fit_decreasing([u.size(lengths) for u in units], capacity)
    return [_pack_one(trajectories, [units[u] for u in b], pad_to_multiple, pad_to_length) for b in bins]


def _pack_one(
    trajectories: Sequence[Trajectory], units: list[_Unit], pad_to_multiple: int, pad_to_length: int | None = None
) -> PackedBatch:
    ids, pos, tgt, mask, adv, gen, les, cu, index, prefix = [], [], [], [], [], [], [], [0], [], []
    plan_rows, plan_ids = [], []

    def segment(t: Trajectory, start: int, end: int, trained: bool, traj: int, of: int) -> None:
        n = end - start
        for p, ids_ in t.plans if trained else ():  # token p is the target of position p - 1
            if start <= p - 1 < end:
                plan_rows.append(len(ids) + p - 1 - start)
                plan_ids.append(ids_)
        ids.extend(t.token_ids[start:end])
        pos.extend(range(start, end))
        tgt.extend(t.token_ids[start + 1 : end + 1] + [0] * (end == len(t.token_ids)))
        # loss_mask[i] marks token i as generated; as a *target* it is predicted at position i-1.
        # The shifted lists end one short of the trajectory's last position: a 0 there (no target).
        if trained:
            mask.extend(t.loss_mask[start + 1 : end + 1] + [0] * (end == len(t.token_ids)))
            gen.extend(t.gen_logprobs[start + 1 : end + 1] + [0.0] * (end == len(t.token_ids)))
            # the advantage of each position's target: its turn's (per-turn credit), else the episode's;
            # the last position (no target) repeats the last token's
            a = t.token_advantages()
            adv.extend(a[start + 1 : end + 1] + a[-1:] * (end == len(t.token_ids)))
        else:
            mask.extend([0] * n)
            gen.extend([0.0] * n)
            adv.extend([0.0] * n)
        les.extend([float(trained and bool(t.meta.get("lesson")))] * n)
        cu.append(cu[-1] + n)
        index.append(traj)
        prefix.append(of)

    for unit in units:
        of = -1
        if unit.shared:
            first = trajectories[unit.members[0]]
            assert not any(first.loss_mask[1 : unit.shared + 1]), "a shared prompt holds a loss target"
            of = len(index)
            segment(first, 0, unit.shared, False, SHARED_PROMPT, -1)
        for i in unit.members:
            t = trajectories[i]
            segment(t, unit.shared, len(t.token_ids), True, i, of)
    pad = max(pad_to_length or 0, len(ids)) - len(ids)
    pad += (-(len(ids) + pad)) % pad_to_multiple
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
        index.append(PADDING)
        prefix.append(-1)
        pad -= n
    T = len(ids)
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    width = max(map(len, plan_ids), default=0)
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
        traj_index_B=index,
        gen_logprobs_T=torch.tensor(gen, dtype=torch.float32),
        lesson_T=torch.tensor(les, dtype=torch.float32),
        prefix_B=prefix if any(p >= 0 for p in prefix) else None,
        plan_rows_P=torch.tensor(plan_rows, dtype=torch.long) if plan_rows else None,
        plan_ids_PB=torch.tensor([list(s) + [-1] * (width - len(s)) for s in plan_ids]) if plan_rows else None,
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
