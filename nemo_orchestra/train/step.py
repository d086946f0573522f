"""One training step of the learner: the step's packs, reference logprobs, the GRPO and SFT losses,
forward/backward through the pipeline and the optimizer step, metrics reduced over the step; the
GRPO update of a batch of rollouts as ``loss.minibatches`` such steps."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from functools import partial

import torch
import torch.distributed as dist

from nemo_orchestra.config import LossConfig, ParallelConfig
from nemo_orchestra.grpo.loss import policy_loss, tis_weights
from nemo_orchestra.megatron.forward import (
    forward_logprobs,
    loss_rows,
    pack_logprobs,
    packed_forward,
    pp_size,
    run_schedule,
)
from nemo_orchestra.megatron.vocab_parallel import set_logprobs
from nemo_orchestra.train.divergence import (
    all_finite,
    any_rank,
    grad_tensors,
    loss_scale_search,
    skip_optimizer_step,
)
from nemo_orchestra.train.packing import pack, padding_pack
from nemo_orchestra.train.learner import Learner
from nemo_orchestra.types import PackedBatch, Trajectory

log = logging.getLogger(__name__)


def pack_for_step(trajs: list[Trajectory], parallel: ParallelConfig, share_prompts: bool = False) -> list[PackedBatch]:
    """The step's microbatches; collective over the data-parallel and model-parallel groups.

    Packs are padded to a TP multiple, and under PP all to one length (``microbatch_tokens``, or the
    longest trajectory if longer); with ``share_prompts`` a common prompt is packed once per unit
    (``train/packing.py``). Empty when no data-parallel rank has a token to train on; when
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
    batches = pack(
        trajs,
        parallel.microbatch_tokens,
        pad_to_multiple=parallel.tp,
        pad_to_length=length,
        share_prompts=share_prompts,
    )
    tokens = data_parallel_sum([sum(float(b.loss_mask_T.sum()) for b in batches)])[0]
    if tokens == 0:
        return []
    return broadcast_in_model_parallel_group(batches or [padding_pack(length or parallel.tp, parallel.tp)])


def reference_logprobs(learner: Learner, batches: list[PackedBatch], temperature: float = 1.0) -> list[torch.Tensor]:
    with learner.reference_model() as model:
        return forward_logprobs(model, batches, learner.device, temperature, only_loss_tokens=True)


class ReferenceAhead:
    """The frozen reference's logprobs of the step's packs, computed pack by pack on a thread of its own
    (``threads`` torch threads) while the update trains on the packs before them: the loss of a pack
    waits only for its own (``PackedBatch.ref_pending``). On a CPU whose engine has cores of its own
    (rollouts ahead of training) the trainer's passes run on one thread; this second one runs beside
    them, on the engine's cycles. The reference and the policy are separate modules and the passes
    hold no state in common: results are the same as ``reference_logprobs`` before the update.
    Not with tensor or pipeline parallelism, whose collectives two threads would interleave.

    ``idle``: the thread runs at idle priority (``idle_priority``), on cycles no other thread wants,
    for a step whose engine is behind (the trainer waited for its rollouts): it then takes nothing from
    generation. Otherwise at normal priority, so it shares the engine's core while the engine keeps
    ahead of the trainer (see ``Trainer.reference_ahead``)."""

    def __init__(
        self,
        learner: Learner,
        batches: list[PackedBatch],
        temperature: float = 1.0,
        threads: int = 1,
        idle: bool = True,
    ):
        self.learner, self.batches, self.temperature, self.threads = learner, batches, temperature, threads
        self.idle = idle
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.waited_s = 0.0  # the update's waits for packs not yet done
        self.ready = [threading.Event() for _ in batches]
        self.cancelled = threading.Event()
        for i, b in enumerate(batches):
            b.ref_logprobs_T, b.ref_pending = None, partial(self.wait, i)
        self.thread = threading.Thread(target=self._run, name="reference-logprobs", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        torch.set_num_threads(self.threads)  # a new thread starts with the process's default
        if self.idle:
            idle_priority()
        try:
            with torch.no_grad(), self.learner.reference_model() as model:
                for b, ready in zip(self.batches, self.ready):
                    if self.cancelled.is_set():
                        break
                    b.ref_logprobs_T = forward_logprobs(model, b, self.learner.device, self.temperature, True)
                    ready.set()
        except BaseException as e:  # re-raised by the waiting loss and by join()
            self.error = e
        finally:
            for ready in self.ready:
                ready.set()
            self.seconds = time.perf_counter() - t0

    def cancel(self) -> None:
        """The update failed: stop after the pack in progress and wait for the thread (no error raised)."""
        self.cancelled.set()
        self.thread.join()
        for b in self.batches:
            b.ref_pending = None

    def wait(self, i: int) -> None:
        """Until pack ``i``'s reference logprobs are there; raises what the thread raised."""
        if not self.ready[i].is_set():
            t0 = time.perf_counter()
            self.ready[i].wait()
            self.waited_s += time.perf_counter() - t0
        self._raise_failure()

    def join(self) -> float:
        """Wait for the thread; its seconds. Raises what it raised."""
        self.thread.join()
        for b in self.batches:
            b.ref_pending = None
        self._raise_failure()
        return self.seconds

    def _raise_failure(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"reference logprobs failed: {self.error}") from self.error


def idle_priority() -> None:
    """The calling thread runs only on cycles no other thread wants (Linux ``SCHED_IDLE``)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: a normal thread
        log.debug("reference logprobs at normal priority: %s", e)


def grpo_loss_fn(loss_cfg: LossConfig):
    """The GRPO loss of a pack. Its old logprobs are the pack's ``old_logprobs_T`` or, when that is
    None, the update's own forward, detached: with one optimizer step per batch of rollouts
    (``loss.minibatches=1``) the policy that sampled them (as the trainer computes it) is the policy
    being updated, so a separate forward pass would give the same numbers (the ratio is 1 either
    way; TRL's GRPO trainer does the same when it takes one step per generation). Also reports
    ``rollout/logprob_mismatch``, mean |trainer - generator| logprob over generated tokens, and with
    ``loss.tis_cap`` ``loss/tis_capped_share``, the share of them whose importance weight the cap bounds.

    Copy lessons in the pack (``lesson_T``, ``loss.copy_lesson_coef``) carry their coefficient as the
    advantage, so their term is that multiple of their log-likelihood's gradient; nothing sampled
    them, so they take no importance weight and stay out of the mismatch."""

    def fn(lp_T: torch.Tensor, batch: PackedBatch):
        dev = lp_T.device
        if batch.ref_pending is not None:  # computed ahead on another thread (ReferenceAhead)
            batch.ref_pending()
        old = lp_T.detach() if batch.old_logprobs_T is None else batch.old_logprobs_T.to(dev)
        mask = batch.loss_mask_T.to(dev)
        lesson = None if batch.lesson_T is None else batch.lesson_T.to(dev)
        sampled = mask if lesson is None else mask * (1.0 - lesson)
        weights = None
        if loss_cfg.tis_cap is not None:
            assert batch.gen_logprobs_T is not None, "loss.tis_cap needs the generator's logprobs in the pack"
            weights = tis_weights(old, batch.gen_logprobs_T.to(dev), loss_cfg.tis_cap)
            if lesson is not None:
                weights = torch.where(lesson > 0, torch.ones_like(weights), weights)
        loss_sum, n, metrics = policy_loss(
            lp_T, old, batch.ref_logprobs_T.to(dev), batch.advantages_T.to(dev), mask, loss_cfg, is_weights_T=weights
        )
        if batch.gen_logprobs_T is not None:
            gap = (old - batch.gen_logprobs_T.to(dev)).abs()
            metrics["rollout/logprob_mismatch"] = (gap * sampled).sum() / sampled.sum().clamp_min(1.0)
        if weights is not None:  # the sampled tokens whose weight the cap bounds
            capped = (weights >= loss_cfg.tis_cap).float() * sampled
            metrics["loss/tis_capped_share"] = capped.sum() / sampled.sum().clamp_min(1.0)
        return loss_sum, n, metrics

    return fn


def minibatch_packs(
    trajs: list[Trajectory], n: int, parallel: ParallelConfig, share_prompts: bool = False
) -> list[list[PackedBatch]]:
    """This rank's trajectories in ``n`` contiguous runs (sizes differ by at most one), each packed by
    ``pack_for_step``; collective, so every data-parallel rank keeps the same minibatches: one that
    has no loss token on any rank is dropped everywhere."""
    runs = [trajs[i * len(trajs) // n : (i + 1) * len(trajs) // n] for i in range(n)]
    return [packs for packs in (pack_for_step(run, parallel, share_prompts) for run in runs) if packs]


def grpo_update(
    learner: Learner,
    minibatches: list[list[PackedBatch]],
    loss_cfg: LossConfig,
    temperature: float = 1.0,
    *,
    step: int,
) -> dict:
    """The GRPO update of one batch of rollouts, GRPO step ``step`` (the trainer's count, from 1; the step
    a divergence message names): one optimizer step per minibatch of packs (``minibatch_packs``;
    reference logprobs filled).

    One minibatch (``loss.minibatches=1``): old logprobs = the step's own forward, detached (ratio 1:
    the clip never binds, the loss is the policy gradient plus the KL term). Several: first a
    forward-only pass of the policy at the rollout temperature over every pack gives the old
    logprobs (the sampling policy's, before any step); then one step per minibatch, each normalized
    by its own global token count. From the second step on the policy has moved, and the clip
    bounds how far it goes.

    Metrics: token-weighted means of the steps' ``loss/*`` and ``train/*``, their summed
    ``train/loss_tokens`` and ``train/optimizer_steps``, and ``train/steps_skipped_total``, the
    optimizer steps skipped so far for non-finite loss or gradients (``train_step``). A ``loss/kl``
    above ``trainer.kl_warn`` is reported once (``StepGuard.check_kl``).
    """
    loss_fn = grpo_loss_fn(loss_cfg)
    learner.guard.step = step
    if len(minibatches) == 1:
        out = {**train_step(learner, minibatches[0], loss_fn, temperature), "train/optimizer_steps": 1.0}
    else:
        t0 = time.perf_counter()
        packs = [b for mb in minibatches for b in mb]
        olds = forward_logprobs(learner.model, packs, learner.device, temperature, only_loss_tokens=True)
        for b, lp in zip(packs, olds, strict=True):
            b.old_logprobs_T = lp
        t_old = time.perf_counter() - t0
        steps = [train_step(learner, mb, loss_fn, temperature) for mb in minibatches]
        out = {**mean_over_steps(steps), "time/old_logprobs_s": t_old}
    out["train/steps_skipped_total"] = float(learner.guard.total)
    learner.guard.check_kl(out.get("loss/kl"))
    return out


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


def warm_start_loss_fn(lp_T: torch.Tensor, batch: PackedBatch):
    """Summed negative log-likelihood of the generated (assistant) tokens."""
    mask = batch.loss_mask_T.to(lp_T.device)
    n = mask.sum()
    nll = -(lp_T * mask).sum()
    return nll, n, {"loss/nll": nll.detach() / n.clamp_min(1.0), "loss/tokens": n}


def _loss_func(batch: PackedBatch, loss_fn, temperature: float, rows, logits):
    """The loss of a pack from its loss rows' logits (``packed_forward`` with ``loss_rows``): logprobs
    scattered back to the pack's length (0 off the loss), entropy over the rows."""
    lp_T, ent = pack_logprobs(logits, batch, rows, temperature, with_entropy=True)
    loss_sum, n, metrics = loss_fn(lp_T, batch)
    in_loss = batch.loss_mask_T.to(ent.device) > 0  # a plan's row outside the loss mask: not a loss token
    ent = ent[in_loss if rows is None else in_loss[rows.to(ent.device)]]
    metrics["train/entropy"] = ent.sum() / max(ent.numel(), 1)
    if batch.plan_coef > 0 and batch.plan_rows_P is not None:
        plan_lp = restatement_logprobs(logits, batch, rows, temperature)
        loss_sum = loss_sum - batch.plan_coef * plan_lp.sum()
        metrics["train/restated_plan_mass"] = plan_lp.detach().exp().mean()
    return loss_sum, n.to(torch.int), metrics


def restatement_logprobs(logits_1NV: torch.Tensor, batch: PackedBatch, rows_N: torch.Tensor | None, temperature: float):
    """The log-probability, at each of the pack's one-token plans, of the plans that restate its task's kind and
    preference right (``loss.restatement_coef``); from the logits of ``packed_forward(..., rows_N)``."""
    plan_rows = batch.plan_rows_P.to(logits_1NV.device)
    at = plan_rows if rows_N is None else torch.searchsorted(rows_N, plan_rows)
    return set_logprobs(logits_1NV[0][at], batch.plan_ids_PB.to(logits_1NV.device), temperature)


def forward_backward(learner: Learner, batches: list[PackedBatch], loss_fn, temperature: float = 1.0) -> list[dict]:
    """Gradients of the step's summed loss / its global token count, in the DDP grad buffers.

    Returns the last stage's per-microbatch metrics (an empty list on other stages).
    """
    model, device = learner.model, learner.device
    model.train()
    model.zero_grad_buffer()
    learner.optimizer.zero_grad()

    def forward_step(data_iterator, m):
        batch = next(data_iterator)
        rows = loss_rows(batch, device, plans=True)
        return packed_forward(m, batch, device, rows), partial(_loss_func, batch, loss_fn, temperature, rows)

    return run_schedule(model, forward_step, batches, forward_only=False)


def train_step(learner: Learner, batches: list[PackedBatch], loss_fn, temperature: float = 1.0) -> dict:
    """One optimizer step over all microbatches (gradients summed, scaled by 1/global tokens).

    A non-finite loss or gradient on any rank skips the step on every rank, in every precision:
    weights and optimizer state stay as they were (``train/divergence.py``). ``trainer.max_skipped_steps``
    skipped in a row, or a step that leaves non-finite weights, raise ``TrainingDiverged``."""
    from nemo_orchestra.megatron.cpu_compat import cuda_type_names

    guard = learner.guard
    guard.begin("warm start" if loss_fn is warm_start_loss_fn else "grpo")
    losses = forward_backward(learner, batches, loss_fn, temperature)
    out = reduce_metrics(losses)
    loss_finite = all(math.isfinite(v) for k, v in out.items() if k.startswith("loss/"))
    bad_loss, bad_grads = any_rank(not loss_finite, not all_finite(grad_tensors(learner.model)))
    if bad_loss or bad_grads:
        scale_search = not bad_loss and loss_scale_search(learner)  # fp16: Megatron's loss scale backs off
        skip_optimizer_step(learner)
        ok, grad_norm = False, math.nan
        if scale_search:
            guard.total += 1
            log.warning("optimizer step skipped (gradients overflow the fp16 loss scale, which backs off)")
        else:
            guard.skipped("loss" if bad_loss else "gradients")
    else:
        with cuda_type_names():
            ok, grad_norm, _ = learner.optimizer.step()
        if not ok:  # Megatron's own check (a loss-scale overflow)
            guard.total += 1
            log.warning("optimizer step skipped (non-finite gradients)")
        elif any_rank(not all_finite(learner.module.parameters()))[0]:
            raise guard.diverged("the optimizer step made the weights non-finite")
        else:
            guard.taken()
    out.update({"train/grad_norm": float(grad_norm or 0.0), "train/step_skipped": float(not ok)})
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
