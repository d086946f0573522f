"""Settings derived from the config and the machine, decided once when a run is built (``RunPlan``)
and read everywhere after: the trainer, the engine's start and the benchmarks ask the plan, not the
keys it derives from."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from nemo_orchestra.config import Config


@dataclass(frozen=True)
class RunPlan:
    reference_pass: bool  # the frozen reference's logprobs run each step (``loss.kl_coef`` > 0)
    rollouts_ahead: int  # K: a step's rollouts start up to K steps early (``rollout.steps_ahead``; 0: synchronous)
    live_sequences: int  # the most sequences the engine holds at once (``live_sequences``)
    engine_cpus: tuple[int, ...] | None  # the engine worker's cores, the trainer's the rest (``engine_cpus``)
    overlap_reference: bool  # reference logprobs on a thread beside the update (``overlap_reference``)
    warm_start_skip: str | None = None  # why the run has no warm start; None: it has one (``warm_start_reason``)
    copy_lessons: int = 0  # copy lessons to make: for the warm start, or GRPO's lesson batches (``copy_lessons``)

    @classmethod
    def make(cls, cfg: Config, device: torch.device, resume_from: str | None = None) -> RunPlan:
        """``resume_from``: the checkpoint the run resumes from (``run_control.check_resume``), if any."""
        cpus = engine_cpus(cfg, device)
        skip = warm_start_reason(cfg, resume_from)
        return cls(
            reference_pass=cfg.loss.kl_coef > 0,
            rollouts_ahead=cfg.rollout.steps_ahead,
            live_sequences=live_sequences(cfg),
            engine_cpus=tuple(cpus) if cpus else None,
            overlap_reference=overlap_reference(cfg, device),
            warm_start_skip=skip,
            copy_lessons=copy_lessons(cfg, skip),
        )

    @property
    def trainer_threads(self) -> int | None:
        """torch threads for the trainer when the engine has cores of its own; None: leave them."""
        if not self.engine_cpus:
            return None
        return max(1, len(os.sched_getaffinity(0)) - len(self.engine_cpus))


def live_sequences(cfg: Config) -> int:
    """The most sequences a rank keeps in its engine at once: a step's rollouts (prompts x group; the
    extra prompts of dynamic sampling come after them, at most as many), and with rollouts ahead
    those of each step in flight. The engine's KV cache holds them (``vllm.default_kv_bytes``)."""
    r = cfg.rollout
    return cfg.data.prompts_per_step * r.group_size * max(1, r.steps_ahead)


def engine_cpus(cfg: Config, device) -> list[int] | None:
    """The cores for the vLLM engine's worker when rollouts run ahead of training on a CPU
    (``rollout.steps_ahead`` >= 1): the engine and the trainer then compute at the same time, and
    both taking every core oversubscribes them.
    The engine gets the first half of this process's cores (at least one), the trainer's torch
    threads the rest. None, leaving vLLM's own binding, when synchronous, on CUDA, with another engine,
    with one core, or with ``VLLM_CPU_OMP_THREADS_BIND`` set."""
    if (
        device.type != "cpu"
        or cfg.rollout.engine != "vllm"
        or cfg.rollout.steps_ahead < 1
        or "VLLM_CPU_OMP_THREADS_BIND" in os.environ
    ):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    return cores[: len(cores) // 2]


def overlap_reference(cfg: Config, device) -> bool:
    """Whether the reference logprobs run on a thread beside the update (``perf.overlap_reference``; see
    ``train/step.py: ReferenceAhead``). null: where the engine has cores of its own on a CPU
    (``engine_cpus``) and the trainer's passes one thread, so a second one finds the engine's idle
    cycles; not with tensor or pipeline parallelism (collectives from two threads), nor with
    ``reference.offload`` (the reference's weights are swapped into the policy's module). Never
    without a reference pass."""
    if cfg.loss.kl_coef == 0:
        return False
    if cfg.perf.overlap_reference is not None:
        return bool(cfg.perf.overlap_reference)
    return (
        cfg.parallel.tp == 1 and cfg.parallel.pp == 1 and not cfg.reference.offload and bool(engine_cpus(cfg, device))
    )


def warm_start_reason(cfg: Config, resume_from: str | None) -> str | None:
    """Why this run has no warm start (None: it has one): ``warm_start.steps=0``, ``model.init_from``, or a
    resume past it."""
    if cfg.warm_start.steps == 0:
        return "warm_start.steps=0"
    if cfg.model.init_from:
        return f"the policy starts from model.init_from={cfg.model.init_from}"
    if resume_from:
        return f"resuming from {resume_from}"
    return None


def copy_lessons(cfg: Config, warm_start_skip: str | None) -> int:
    """How many copy lessons the run makes: the warm start's (``warm_start.copy_lessons``), also for GRPO's
    lesson batches (``loss.copy_lesson_coef`` > 0, made again on a resume); none when neither trains."""
    if warm_start_skip is None or cfg.loss.copy_lesson_coef > 0:
        return cfg.warm_start.copy_lesson_count(cfg.data.train_path)
    return 0
