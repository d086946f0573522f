"""One training step of the policy: the step's packs, reference logprobs, the GRPO and SFT losses,
forward/backward through the pipeline and the optimizer step, metrics reduced over the step; the
GRPO update of a batch of rollouts as ``loss.minibatches`` such steps."""

from __future__ import annotations

import itertools
import logging
import time
from functools import partial

import torch
import torch.distributed as dist

from nemo_orchestra.config import LossConfig, ParallelConfig
from nemo_orchestra.grpo.loss import policy_loss, tis_weights
from nemo_orchestra.megatron.forward import (
    forward_logprobs,
    packed_forward,
    pp_size,
    run_schedule,
)
from nemo_orchestra.megatron.vocab_parallel import logprobs_and_entropy
from nemo_orchestra.train.packing import PAD_SEQUENCE, first_fit_decreasing, pack, padding_pack
from nemo_orchestra.train.policy import Policy
from nemo_orchestra.types import PackedBatch, Trajectory

log = logging.getLogger(__name__)


def pack_for_step(trajs: list[Trajectory], parallel: ParallelConfig) -> list[PackedBatch]:
    """The step's microbatches; collective over the data-parallel and model-parallel groups.

    Packs are padded to a TP multiple, and under PP all to one length (``microbatch_tokens``, or the
    longest trajectory if longer). Empty when no data-parallel rank has a token to train on; when
    only this rank has none, one all-padding pack, so that every rank joins the gradient reduction.
    The ranks of one model replica all get the packs of its first rank (they must see one batch).
    """
    from nemo_orchestra.megatron.parallel import (
        broadcast_in_model_parallel_group,
        data_parallel_sum,
    )

    length = None
    if parallel.pp > 1:
        length = max([parallel.microbatch_tokens] + [len(t.token_ids) for t in trajs])
    batches = pack(trajs, parallel.microbatch_tokens, pad_to_multiple=parallel.tp, pad_to_length=length)
    tokens = data_parallel_sum([sum(float(b.loss_mask_T.sum()) for b in batches)])[0]
    if tokens == 0:
        return []
    return broadcast_in_model_parallel_group(batches or [padding_pack(length or parallel.tp, parallel.tp)])


def reference_logprobs(policy: Policy, batches: list[PackedBatch], temperature: float = 1.0) -> list[torch.Tensor]:
    with policy.reference_model() as model:
        return forward_logprobs(model, batches, policy.device, temperature)


def grpo_loss_fn(loss_cfg: LossConfig):
    """The GRPO loss of a pack. Its old logprobs are the pack's ``old_logprobs_T`` or, when that is
    None, the update's own forward, detached: with one optimizer step per batch of rollouts
    (``loss.minibatches=1``) the policy that sampled them (as the trainer computes it) is the policy
    being updated, so a separate forward pass would give the same numbers (the ratio is 1 either
    way; TRL's GRPO trainer does the same when it takes one step per generation). Also reports
    ``rollout/logprob_mismatch``, mean |trainer - generator| logprob over generated tokens."""
    def fn(lp_T: torch.Tensor, batch: PackedBatch):
        dev = lp_T.device
        old = lp_T.detach() if batch.old_logprobs_T is None else batch.old_logprobs_T.to(dev)
        weights = None
        if loss_cfg.tis_cap is not None:
            assert batch.gen_logprobs_T is not None, "loss.tis_cap needs the generator's logprobs in the pack"
            weights = tis_weights(old, batch.gen_logprobs_T.to(dev), loss_cfg.tis_cap)
        mask = batch.loss_mask_T.to(dev)
        loss_sum, n, metrics = policy_loss(lp_T, old, batch.ref_logprobs_T.to(dev), batch.advantages_T.to(dev), mask,
                                           loss_cfg, is_weights_T=weights)
        if batch.gen_logprobs_T is not None:
            gap = (old - batch.gen_logprobs_T.to(dev)).abs()
            metrics["rollout/logprob_mismatch"] = (gap * mask).sum() / mask.sum().clamp_min(1.0)
        return loss_sum, n, metrics

    return fn


def grpo_update(policy: Policy, batches: list[PackedBatch], loss_cfg: LossConfig, parallel: ParallelConfig,
                temperature: float = 1.0) -> dict:
    """The GRPO update of one batch of rollouts (the step's ``batches``, reference logprobs filled):
    ``loss.minibatches`` = N optimizer steps.

    N = 1: one step on every pack, old logprobs = its own forward, detached (ratio 1: the clip
    never binds, the loss is the policy gradient plus the KL term). N > 1: first a forward-only
    pass of the policy at the rollout temperature gives the old logprobs (the sampling policy's,
    before any step); then this rank's trajectories are split into N minibatches
    (``split_minibatches``), one optimizer step each, each normalized by its own global token
    count. From the second step on the policy has moved, and the clip bounds how far it goes.

    Metrics: token-weighted means of the steps' ``loss/*`` and ``train/*``, their summed
    ``train/loss_tokens`` and ``train/optimizer_steps``.
    """
    loss_fn = grpo_loss_fn(loss_cfg)
    if loss_cfg.minibatches == 1:
        return {**train_step(policy, batches, loss_fn, temperature), "train/optimizer_steps": 1.0}
    t0 = time.perf_counter()
    for b, lp in zip(batches, forward_logprobs(policy.model, batches, policy.device, temperature), strict=True):
        b.old_logprobs_T = lp
    t_old = time.perf_counter() - t0
    steps = [train_step(policy, mb, loss_fn, temperature)
             for mb in split_minibatches(batches, loss_cfg.minibatches, parallel) if mb]
    return {**mean_over_steps(steps), "time/old_logprobs_s": t_old}


Segment = tuple[int, PackedBatch, int, int]  # (trajectory index or -1, pack, start, end): one sequence


def split_minibatches(batches: list[PackedBatch], n: int, parallel: ParallelConfig) -> list[list[PackedBatch]]:
    """This rank's trajectories in ``n`` minibatches, each packed as ``pack_for_step`` packs.

    Whole trajectories (every per-token field kept), in trajectory order, in ``n`` contiguous runs
    whose sizes differ by at most one. Collective over the data-parallel group, so that every rank
    takes the same optimizer steps: a minibatch with no loss token on any rank is [] on every rank
    (it is skipped), one with none on this rank only is one all-padding pack.
    """
    from nemo_orchestra.megatron.parallel import data_parallel_sum

    seqs = sorted((s for b in batches for s in _segments(b) if s[0] >= 0), key=lambda s: s[0])
    runs = [seqs[i * len(seqs) // n:(i + 1) * len(seqs) // n] for i in range(n)]
    tokens = data_parallel_sum([sum(float(b.loss_mask_T[lo:hi].sum()) for _, b, lo, hi in r) for r in runs])
    out = []
    for run, total in zip(runs, tokens):
        length = None
        if parallel.pp > 1:  # one length for every pack of the step, as in pack_for_step
            length = max([parallel.microbatch_tokens] + [hi - lo for _, _, lo, hi in run])
        bins = first_fit_decreasing([hi - lo for _, _, lo, hi in run], parallel.microbatch_tokens)
        packs = [_join([run[i] for i in sorted(b)], parallel.tp, length) for b in bins]
        out.append([] if total == 0 else packs or [padding_pack(length or parallel.tp, parallel.tp)])
    return out


def _segments(b: PackedBatch) -> list[Segment]:
    cu = b.cu_seqlens_B1.tolist()
    return [(j, b, lo, hi) for j, lo, hi in zip(b.traj_index_B, cu[:-1], cu[1:])]


_PER_TOKEN = ("input_ids_T", "position_ids_T", "target_ids_T", "loss_mask_T", "advantages_T", "old_logprobs_T",
              "ref_logprobs_T", "gen_logprobs_T")


def _join(segs: list[Segment], multiple: int, length: int | None) -> PackedBatch:
    """One pack of these sequences, padded like ``packing.pack`` (to ``length`` tokens, then to a ``multiple``)."""
    used = sum(hi - lo for _, _, lo, hi in segs)
    pad = max(length or 0, used) - used
    pad += (-(used + pad)) % multiple
    while pad:  # short padding sequences, their attention costs little
        k = min(pad, PAD_SEQUENCE)
        segs = segs + [(-1, padding_pack(k), 0, k)]
        pad -= k
    lens = [hi - lo for _, _, lo, hi in segs]
    fields = {}
    for f in _PER_TOKEN:
        parts = [getattr(b, f) for j, b, _, _ in segs if j >= 0]
        if any(p is None for p in parts):  # e.g. no generator logprobs
            fields[f] = None
        else:
            fields[f] = torch.cat([getattr(b, f)[lo:hi] for _, b, lo, hi in segs])
    return PackedBatch(**fields, cu_seqlens_B1=torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32),
                       max_seqlen=max(lens), traj_index_B=[j for j, *_ in segs])


def mean_over_steps(steps: list[dict]) -> dict[str, float]:
    """Token-weighted means of the optimizer steps' metrics (weights: each step's ``train/loss_tokens``,
    summed in the result), and ``train/optimizer_steps``."""
    weights = [float(s.get("train/loss_tokens", 0.0)) for s in steps]
    sums: dict[str, list[float]] = {}
    for s, w in zip(steps, weights):
        for k, v in s.items():
            acc = sums.setdefault(k, [0.0, 0.0])
            acc[0] += float(v) * w
            acc[1] += w
    out = {k: v / w if w > 0 else 0.0 for k, (v, w) in sums.items()}
    out["train/loss_tokens"] = sum(weights)
    out["train/optimizer_steps"] = float(len(steps))
    return out


def sft_loss_fn(lp_T: torch.Tensor, batch: PackedBatch):
    """Summed negative log-likelihood of the generated (assistant) tokens."""
    mask = batch.loss_mask_T.to(lp_T.device)
    n = mask.sum()
    nll = -(lp_T * mask).sum()
    return nll, n, {"loss/nll": nll.detach() / n.clamp_min(1.0), "loss/tokens": n}


def _loss_func(batch: PackedBatch, loss_fn, temperature: float, logits):
    lp, ent = logprobs_and_entropy(logits[0], batch.target_ids_T.to(logits.device), temperature)
    loss_sum, n, metrics = loss_fn(lp, batch)
    mask = batch.loss_mask_T.to(ent.device)
    metrics["train/entropy"] = (ent * mask).sum() / mask.sum().clamp_min(1.0)
    return loss_sum, n.to(torch.int), metrics


def forward_backward(policy: Policy, batches: list[PackedBatch], loss_fn, temperature: float = 1.0) -> list[dict]:
    """Gradients of the step's summed loss / its global token count, in the DDP grad buffers.

    Returns the last stage's per-microbatch metrics (an empty list on other stages).
    """
    model, device = policy.model, policy.device
    model.train()
    model.zero_grad_buffer()
    policy.optimizer.zero_grad()

    def forward_step(data_iterator, m):
        batch = next(data_iterator)
        return packed_forward(m, batch, device), partial(_loss_func, batch, loss_fn, temperature)

    return run_schedule(model, forward_step, batches, forward_only=False)


def train_step(policy: Policy, batches: list[PackedBatch], loss_fn, temperature: float = 1.0) -> dict:
    """One optimizer step over all microbatches (gradients summed, scaled by 1/global tokens)."""
    from nemo_orchestra.megatron.cpu_compat import cuda_type_names

    losses = forward_backward(policy, batches, loss_fn, temperature)
    with cuda_type_names():
        ok, grad_norm, _ = policy.optimizer.step()
    if not ok:
        log.warning("optimizer step skipped (non-finite gradients)")
    out = {"train/grad_norm": float(grad_norm or 0.0), "train/step_skipped": float(not ok)}
    out.update(reduce_metrics(losses))
    return out


def reduce_metrics(losses: list[dict]) -> dict[str, float]:
    """Token-weighted means of the microbatch metrics over the whole step (all stages, all DP ranks)."""
    from megatron.core import parallel_state as ps

    from nemo_orchestra.megatron.parallel import data_parallel_sum

    sums: dict[str, float] = {}
    for d in losses:
        n = float(d["loss/tokens"])
        for k, v in d.items():
            sums[k] = sums.get(k, 0.0) + (n if k == "loss/tokens" else float(v) * n)
    if pp_size() > 1:  # metrics exist on the last stage only
        box = [sums]
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
        sums = box[0]
    if not sums:
        return {}
    keys = sorted(sums)
    total = dict(zip(keys, data_parallel_sum([sums[k] for k in keys])))
    toks = total.pop("loss/tokens")
    out = {k: v / max(toks, 1.0) for k, v in total.items()}
    out["train/loss_tokens"] = toks
    return out
