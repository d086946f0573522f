"""A diverging run: an optimizer step whose loss or gradients are not finite is skipped, in every
precision (fp32 included): the weights and the optimizer state stay as they were, and the step is
counted (``train/step_skipped``, ``train/steps_skipped_total``). ``trainer.max_skipped_steps`` such
steps in a row stop the run with ``TrainingDiverged``, one line naming the step and the learning
rate to lower. A step that leaves non-finite weights (finite gradients times a huge learning rate)
cannot be taken back: it stops the run at once. ``loss/kl`` above ``trainer.kl_warn`` is reported
once, by a warning naming the learning rate.

Every rank takes the same decision: each checks its own loss, gradients and weights, and the flags
are reduced over all ranks (one all-reduce of a single number per check).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss, gradients or weights became non-finite and stayed so: the run stops (one line)."""

    def __init__(self, reason: str, where: str, lr_key: str, lr: float | None):
        self.reason, self.where, self.lr_key, self.lr = reason, where, lr_key, lr
        super().__init__(str(self))

    def __str__(self) -> str:
        now = f", now {self.lr:g}" if self.lr is not None else ""
        return f"training diverged at {self.where}: {self.reason} (lower {self.lr_key}{now})"


@dataclass
class StepGuard:
    """The divergence bookkeeping of one learner (``Learner.guard``)."""

    max_skipped: int = 3  # trainer.max_skipped_steps: skipped optimizer steps in a row before the run stops
    kl_warn: float | None = 100.0  # trainer.kl_warn; None: no warning
    lrs: dict[str, float] = field(default_factory=dict)  # the configured rates, by key ("optim.lr", "warm_start.lr")
    step: int = 0  # the GRPO step under way, as the trainer counts it (given by ``grpo_update``)
    warm_start_steps: int = 0  # warm-start (SFT) optimizer steps begun
    in_a_row: int = 0  # optimizer steps skipped since the last one taken
    total: int = 0  # optimizer steps skipped in this process
    kl_warned: bool = False
    phase: str = "grpo"  # "grpo" or "warm start": the learning-rate key a message names

    def begin(self, phase: str) -> None:
        """An optimizer step of ``phase`` begins; a new phase starts the count in a row afresh."""
        if phase != self.phase:
            self.phase, self.in_a_row = phase, 0
        if phase == "warm start":
            self.warm_start_steps += 1

    @property
    def lr_key(self) -> str:
        return "warm_start.lr" if self.phase == "warm start" else "optim.lr"

    @property
    def where(self) -> str:
        return f"warm-start step {self.warm_start_steps}" if self.phase == "warm start" else f"step {self.step}"

    def diverged(self, reason: str) -> TrainingDiverged:
        return TrainingDiverged(reason, self.where, self.lr_key, self.lrs.get(self.lr_key))

    def taken(self) -> None:
        self.in_a_row = 0

    def skipped(self, what: str) -> None:
        """Count a skipped step; raise ``TrainingDiverged`` at ``max_skipped`` in a row."""
        self.in_a_row += 1
        self.total += 1
        log.warning("%s: optimizer step skipped (non-finite %s; %d in a row)", self.where, what, self.in_a_row)
        if self.in_a_row >= self.max_skipped:
            raise self.diverged(f"non-finite loss or gradients in {self.in_a_row} consecutive optimizer steps")

    def check_kl(self, kl) -> None:
        """Warn once when the GRPO step's ``loss/kl`` is above ``trainer.kl_warn``."""
        if self.kl_warn is None or self.kl_warned or kl is None or not math.isfinite(kl) or kl <= self.kl_warn:
            return
        self.kl_warned = True
        lr = self.lrs.get("optim.lr")
        log.warning(
            "%s: loss/kl is %.3g, above trainer.kl_warn=%g: the policy is running away from its reference "
            "(it may be diverging); lower optim.lr%s",
            self.where,
            kl,
            self.kl_warn,
            f" (now {lr:g})" if lr is not None else "",
        )


def any_rank(*flags: bool) -> list[bool]:
    """Each flag true on every rank when it is true on any (one all-reduce; no-op on one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [bool(f) for f in flags]
    from nemo_orchestra.megatron.parallel import comm_device

    t = torch.tensor([float(f) for f in flags], device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity; None if there is
    none (one ``isfinite`` pass per tensor, one sync per device)."""
    names, flags = [], []
    for name, t in named:
        if torch.is_tensor(t) and t.is_floating_point() and t.numel():
            names.append(name)
            flags.append(torch.isfinite(t).all())
    ok = _on_cpu(flags)
    return next((n for n, good in zip(names, ok.tolist()) if not good), None)


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of every floating-point tensor is finite (one pass, one sync per device)."""
    flags = [torch.isfinite(t).all() for t in tensors if t is not None and t.is_floating_point() and t.numel()]
    return bool(_on_cpu(flags).all())


def _on_cpu(flags: list[torch.Tensor]) -> torch.Tensor:
    """Boolean scalars, gathered in their order onto the CPU with one copy per device."""
    out = torch.ones(len(flags), dtype=torch.bool)
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    for idx in by_device.values():
        out[idx] = torch.stack([flags[i] for i in idx]).cpu()
    return out


def grad_tensors(model) -> list[torch.Tensor]:
    """This rank's gradients: the DDP grad buffers (after the data-parallel reduction), else each
    parameter's ``main_grad`` or ``grad``."""
    buffers = list(getattr(model, "buffers", None) or []) + list(getattr(model, "expert_parallel_buffers", None) or [])
    if buffers and all(hasattr(b, "grad_data") for b in buffers):
        return [b.grad_data for b in buffers]
    grads = [getattr(p, "main_grad", None) if hasattr(p, "main_grad") else p.grad for p in model.parameters()]
    return [g for g in grads if g is not None]


def skip_optimizer_step(learner) -> None:
    """Drop the step's gradients without touching weights or optimizer state; a dynamic loss scale
    (fp16) backs off as Megatron's own skip does."""
    learner.model.zero_grad_buffer()
    learner.optimizer.zero_grad()
    for opt in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            scaler.update(True)


def loss_scale_search(learner) -> bool:
    """Whether a dynamic loss scale (fp16) can still back off: an overflow of its scaled gradients is
    then Megatron's search for the scale, not divergence."""
    for opt in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None and hasattr(scaler, "min_scale") and bool(scaler.scale > scaler.min_scale):
            return True
    return False
