"""The warm start: supervised steps on scripted episodes (the tool-call format) and copy lessons (copying
a tool's output into the answer) before GRPO, and the copy lessons GRPO steps keep training on
(``loss.copy_lesson_coef``).

``play_warm_start_episodes`` makes the data: scripted episodes played against the tool service
(``data/warm_start.py``), at assembly. ``warm_start`` trains on them; ``step_lessons`` draws a GRPO
step's lessons, which ``interleave`` spreads over the step's batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from dataclasses import replace

from nemo_orchestra.config import Config
from nemo_orchestra.data.default_tasks import copy_tasks, generate_tasks, search_corpus_seed
from nemo_orchestra.data.warm_start import scripted_episodes
from nemo_orchestra.train.learner import Learner, reset_optimizer_state, set_lr
from nemo_orchestra.train.run_plan import RunPlan
from nemo_orchestra.train.step import pack_for_step, train_step, warm_start_loss_fn
from nemo_orchestra.types import TaskRecord, Trajectory

log = logging.getLogger(__name__)


def corpus_seed(cfg: Config) -> int:
    """The corpus seed of the search tool's world the embedded multi-step tasks are about."""
    return search_corpus_seed(dict(cfg.tools.service), cfg.data.categories)


def warm_start_tasks(cfg: Config, tasks: list) -> list:
    """Tasks for the scripted warm-start episodes: fresh ones for the embedded default (so the
    model learns to copy tool outputs rather than memorize answers), else cycled training tasks."""
    n = max(cfg.warm_start.num_episodes, 1)
    if not cfg.data.train_path:
        return generate_tasks(n, cfg.run.seed + 1, cfg.data.categories, corpus_seed(cfg))
    return [tasks[i % len(tasks)] for i in range(n)]


def play_warm_start_episodes(
    cfg: Config, plan: RunPlan, tasks: list[TaskRecord], client, loop: asyncio.AbstractEventLoop, corpus: bool
) -> tuple[list, list]:
    """The scripted warm-start episodes and the copy-lesson episodes, played against the tool service.
    The scripted ones are played when the run has a warm start or needs them as the embedded tokenizer's
    ``corpus``; the copy lessons when the warm start or GRPO's lesson batches train on them
    (``RunPlan.copy_lessons``, made again on a resume)."""
    skip = plan.warm_start_skip
    if skip is None or corpus:
        chosen = warm_start_tasks(cfg, tasks)
        log.info("scripted warm-start episodes: %d%s", len(chosen), f" (tokenizer corpus; {skip})" if skip else "")
        scripted = loop.run_until_complete(
            scripted_episodes(
                chosen,
                client,
                cfg.run.seed,
                paid_experts=cfg.warm_start.endpoint_experts,
                max_calls=cfg.warm_start.max_calls,
            )
        )
    else:
        log.info("scripted warm-start episodes: none (%s)", skip)
        scripted = []
    copies = []
    if plan.copy_lessons:
        lessons = copy_tasks(plan.copy_lessons, cfg.run.seed + 3, cfg.data.categories, corpus_seed(cfg))
        copies = loop.run_until_complete(
            scripted_episodes(lessons, client, cfg.run.seed, copy=True, paid_experts=cfg.warm_start.endpoint_experts)
        )
        log.info("copy lessons: %d", len(copies))
    return scripted, copies


def warm_start(
    learner: Learner, cfg: Config, plan: RunPlan, scripted: list[Trajectory], lessons: list[Trajectory], rank: int
) -> None:
    """SFT on the scripted trajectories and copy lessons (unless the run has no warm start: ``RunPlan``),
    then the reference policy becomes the warm-started one."""
    ws = cfg.warm_start
    if plan.warm_start_skip is not None:
        if ws.steps > 0:
            log.info("warm start skipped: %s", plan.warm_start_skip)
    else:
        if not scripted:
            raise RuntimeError("warm start: no scripted episodes were made (build_trainer, resume_from)")
        set_lr(learner.optimizer, ws.lr)
        from tqdm import tqdm

        rng = random.Random(cfg.run.seed)
        bar = tqdm(range(ws.steps), desc="warm start", disable=rank != 0, dynamic_ncols=True)
        for i in bar:
            set_lr(learner.optimizer, cosine_lr(ws.lr, ws.min_lr_ratio, i, ws.steps))
            batch = rng.sample(scripted, min(ws.batch_size, len(scripted)))
            batch += rng.sample(lessons, min(ws.copy_lessons_per_step, len(lessons)))
            packs = pack_for_step(batch, cfg.parallel, cfg.share_prompts)
            for b in packs:  # the plans' restatement, as in GRPO's steps
                b.plan_coef = cfg.loss.restatement_coef
            m = train_step(learner, packs, warm_start_loss_fn)
            bar.set_postfix(nll=f"{m.get('loss/nll', float('nan')):.3f}")
        mass = m.get("train/restated_plan_mass")
        log.info(
            "warm start done: %d steps, nll %.4f%s",
            ws.steps,
            m.get("loss/nll", float("nan")),
            "" if mass is None else f", plans' restatement right at p={mass:.3f}",
        )
        set_lr(learner.optimizer, cfg.optim.lr)
        reset_optimizer_state(learner.optimizer)  # GRPO starts with fresh Adam moments
    learner.reset_reference()


def step_lessons(lessons: list[Trajectory], cfg: Config, step: int, dp_rank: int) -> list[Trajectory]:
    """``loss.copy_lessons_per_step`` of the warm start's copy ``lessons`` for GRPO step ``step`` (steps done
    before it) and data-parallel rank (none with ``loss.copy_lesson_coef`` 0 or a run without lessons), each
    with the coefficient as its advantage: the update adds that multiple of their log-likelihood's gradient.
    Their calls are trained, not their plans, so they hold the call format and the copying that the plans'
    updates would otherwise wear away, without pulling the choice of tool. Drawn from (seed, step, rank), so
    a resumed run draws the same."""
    coef, n = cfg.loss.copy_lesson_coef, cfg.loss.copy_lessons_per_step
    if coef <= 0 or n <= 0 or not lessons:
        return []
    rng = random.Random(f"{cfg.run.seed}/lessons/{step}/{dp_rank}")
    picked = rng.sample(range(len(lessons)), min(n, len(lessons)))
    return [replace(lessons[i], advantage=coef, meta={**lessons[i].meta, "lesson": True}) for i in picked]


def interleave(a: list, b: list) -> list:
    """``a`` and ``b`` merged, each in its order, spread evenly over the result."""
    keyed = [((i + 0.5) / len(a), 0, x) for i, x in enumerate(a)] + [
        ((j + 0.5) / len(b), 1, y) for j, y in enumerate(b)
    ]
    return [x for _, _, x in sorted(keyed, key=lambda k: k[:2])]


def cosine_lr(peak: float, min_ratio: float, step: int, steps: int) -> float:
    """Cosine decay from ``peak`` at step 0 to ``peak * min_ratio`` at the last step."""
    frac = step / max(steps - 1, 1)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))
