"""The GRPO loop: each step is a sequence of short named stages.

rollout -> reward -> advantages -> pack -> logprobs (reference) -> train -> sync -> log -> checkpoint

The rollout and reward stages are the rollout source's (``train/rollout_source.py``): a step's rollouts,
each group rewarded as it comes back, made when the step starts or, with ``rollout.steps_ahead=K >= 1``,
while the K steps before it train. The warm start and copy lessons are ``train/warm_start.py``; what a
step reports beside its loss, ``train/step_metrics.py``. ``Trainer.step`` (GRPO steps done) is the one
count of steps: the data position, the lessons' draw, the divergence messages and checkpoints read it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from nemo_orchestra.config import Config
from nemo_orchestra.data.default_tasks import plan_positions
from nemo_orchestra.export.qwen3 import full_state_dict
from nemo_orchestra.grpo.advantages import assign_advantages
from nemo_orchestra.megatron.parallel import broadcast_in_model_parallel_group, data_parallel_gather
from nemo_orchestra.rollout.loop import HELDOUT_SEED
from nemo_orchestra.rollout.managed_engine import ManagedEngine
from nemo_orchestra.runtime.run_control import SaveSchedule, agree, param_versions
from nemo_orchestra.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from nemo_orchestra.train.learner import Learner
from nemo_orchestra.train.metric_logger import MetricLogger
from nemo_orchestra.train.rollout_source import RolloutSource, StepRollouts, drop_stale, on_rollout_rank
from nemo_orchestra.train.run_plan import RunPlan
from nemo_orchestra.train.step import ReferenceAhead, grpo_update, minibatch_packs, reference_logprobs
from nemo_orchestra.train.step_metrics import (
    gradient_variance,
    rollout_metrics,
    rollout_timing,
    train_perf,
    write_samples,
)
from nemo_orchestra.train.warm_start import interleave, step_lessons
from nemo_orchestra.train.warm_start import warm_start as run_warm_start
from nemo_orchestra.types import PackedBatch, TaskRecord, Trajectory
from tools_env.recovery import restarts as tool_service_restarts

log = logging.getLogger(__name__)

# a wait for a step's rollouts longer than this: the engine is behind the trainer (Trainer.reference_ahead)
ENGINE_BEHIND_S = 0.05


@dataclass
class Trainer:
    cfg: Config
    plan: RunPlan  # settings derived from the config and the machine, made once at assembly
    learner: Learner  # the trainable model, its reference and optimizer
    generation: ManagedEngine  # the generation engine, from its start to its close
    rollouts: RolloutSource  # each step's rollouts, rewarded (synchronous or ahead of training)
    logger: MetricLogger
    tokenizer: object = None
    vocab_size: int = 0
    warm_start_trajectories: list[Trajectory] = field(default_factory=list)  # scripted warm-start data
    copy_lessons: list[Trajectory] = field(default_factory=list)  # warm-start copy lessons (data.warm_start)
    rank: int = 0
    step: int = 0  # GRPO steps done: the one count of steps
    plans_unseen_said: bool = False  # mark_plans warned that no one-token plan was found

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.rollouts.episodes.loop

    @property
    def client(self):
        return self.rollouts.episodes.client

    # ---- stages -------------------------------------------------------------------------------------------
    def grpo_step(self) -> dict:
        """GRPO step ``self.step + 1``: rollout and reward, advantages, pack, logprobs, train, sync, log."""
        t0 = time.perf_counter()
        rollouts = self.take_rollouts()  # rollout, reward: each group rewarded as it came back (RolloutSource)
        t_rollout = time.perf_counter() - t0
        t_sleep = self.engine_memory("sleep")  # the engine's GPU memory is the trainer's until the sync
        if self.rank == 0:
            write_samples(self.cfg.run.output_dir, self.rollouts.episodes.chat, self.step + 1, rollouts.trajectories)
        kept, metrics = self.advantages(rollouts.trajectories)
        t1 = time.perf_counter()
        batches, train_metrics = self.train(kept, rollouts.waited_s)
        metrics.update(train_metrics)
        t_train = time.perf_counter() - t1
        metrics.update(train_perf(self.learner, self.cfg, self.vocab_size, self.plan.reference_pass, batches, t_train))
        tasks = self.rollouts.order.tasks_at(self.step)
        metrics["data/task_ids"] = [i for ids in data_parallel_gather([t.id for t in tasks]) for i in ids]
        t_wake = self.engine_memory("wake_up")
        t_sync = self.sync_weights(self.step + 1)
        step_s = time.perf_counter() - t0
        metrics.update(rollout_timing(rollouts, t0, step_s))
        reset = self.reset_reference_if_due(self.step + 1)  # after the weight sync: the reference thread has joined
        metrics["train/reference_reset"] = float(reset)
        metrics.update({"time/engine_sleep_s": t_sleep, "time/engine_wake_s": t_wake})
        metrics["tools_env/restarts"] = float(tool_service_restarts(self.client))
        trajs = rollouts.trajectories
        metrics.update(
            {
                "time/rollout_s": t_rollout,
                "time/train_s": t_train,
                "time/weight_sync_s": t_sync,
                "time/step_s": step_s,
                "perf/tokens_per_s": sum(len(t.token_ids) for t in trajs) / step_s,
                "perf/generated_tokens": sum(t.num_generated for t in trajs),
            }
        )
        return metrics

    def take_rollouts(self) -> StepRollouts:
        """This step's rollouts, made once per model replica: its tensor/pipeline ranks train on the same data."""
        return broadcast_in_model_parallel_group(
            on_rollout_rank(self.generation, lambda: self.rollouts.take(self.step))
        )

    def advantages(self, trajs: list[Trajectory]) -> tuple[list[Trajectory], dict]:
        """The rollouts trained on, with their advantages (stale ones dropped, uninformative groups too), this
        step's copy lessons spread among them, and the rollouts' metrics."""
        fresh, stale_metrics = drop_stale(trajs, self.step, self.plan.rollouts_ahead)
        kept, metrics = assign_advantages(fresh, self.cfg.advantage, self.learner.device, self.cfg.reward)
        every = self.cfg.advantage.grad_variance_every
        if every and self.step % every == 0:
            metrics.update(gradient_variance(self.learner, self.cfg, kept, fresh))
        lessons = step_lessons(self.copy_lessons, self.cfg, self.step, self.rollouts.order.dp_rank)
        kept = interleave(kept, lessons)  # lessons in every minibatch of the update
        metrics["train/lessons"] = float(len(lessons))
        self.mark_plans(kept)
        metrics.update(stale_metrics)
        metrics.update(rollout_metrics(trajs))
        return kept, metrics

    def train(self, kept: list[Trajectory], waited_s: float) -> tuple[list[PackedBatch], dict]:
        """Pack, logprobs, train: the update of GRPO step ``self.step + 1``; its packs and metrics."""
        minibatches = minibatch_packs(kept, self.cfg.loss.minibatches, self.cfg.parallel, self.cfg.share_prompts)
        batches = [b for mb in minibatches for b in mb]
        if not batches:
            return batches, {"train/step_skipped": 1.0}
        for b in batches:
            b.plan_coef = self.cfg.loss.restatement_coef
        metrics: dict = {}
        ahead = self.reference_ahead(batches, waited_s)
        if ahead is None:
            metrics.update(self.fill_logprobs(batches))
        t2 = time.perf_counter()
        try:
            temperature = self.cfg.rollout.temperature
            metrics.update(grpo_update(self.learner, minibatches, self.cfg.loss, temperature, step=self.step + 1))
        except BaseException:
            if ahead is not None:  # no thread left computing beside what comes next
                ahead.cancel()
            raise
        if ahead is not None:
            metrics["time/ref_logprobs_s"] = 0.0  # off the critical path: waits are in the update's time
            metrics["time/ref_logprobs_ahead_s"] = ahead.join()
            metrics["time/ref_logprobs_wait_s"] = ahead.waited_s
            metrics["perf/ref_logprobs_idle"] = float(ahead.idle)
        metrics["time/update_s"] = time.perf_counter() - t2
        return batches, metrics

    def fill_logprobs(self, batches: list[PackedBatch]) -> dict[str, float]:
        """The frozen reference's logprobs, for the KL term (none when ``loss.kl_coef`` is 0). The old
        logprobs are the update's (see grpo_update)."""
        if not self.plan.reference_pass:
            return {"time/ref_logprobs_s": 0.0}
        t0 = time.perf_counter()
        for b, r in zip(batches, reference_logprobs(self.learner, batches, self.cfg.rollout.temperature)):
            b.ref_logprobs_T = r
        return {"time/ref_logprobs_s": time.perf_counter() - t0}

    def reference_ahead(self, batches: list[PackedBatch], waited_s: float = 0.0) -> ReferenceAhead | None:
        """The reference logprobs on a thread of their own, beside the update (``perf.overlap_reference``),
        or None: computed first, by ``fill_logprobs``. The thread runs at idle priority when the trainer
        waited for this step's rollouts (``waited_s`` over ``ENGINE_BEHIND_S``: the engine bounds the
        step, so the thread takes only cycles nothing else wants), else at normal priority: the engine
        keeps ahead, and the thread may take cycles from it."""
        if not self.plan.overlap_reference:
            return None
        idle = waited_s > ENGINE_BEHIND_S
        return ReferenceAhead(self.learner, batches, self.cfg.rollout.temperature, torch.get_num_threads(), idle=idle)

    def sync_weights(self, version: int) -> float:
        """The learner's weights after ``version`` GRPO steps into the engine (``ManagedEngine.sync``)."""
        return self.generation.sync(lambda: full_state_dict(self.learner.module), version)

    def engine_memory(self, action: str) -> float:
        """``sleep`` or ``wake_up`` (``ManagedEngine.memory``)."""
        return self.generation.memory(action, rollouts_ahead=self.rollouts.background)

    def reset_reference_if_due(self, step: int) -> bool:
        """After GRPO step ``step`` (counted from 1): every ``reference.reset_every`` steps the KL reference
        becomes a copy of the updated policy (ProRL's reference reset, Liu et al. 2025), so the KL holds
        each stretch of steps near where it began rather than the whole run near the warm start. Returns
        whether it was reset. The checkpoint saved after the step holds the new reference."""
        every = self.cfg.reference.reset_every
        if not every or step % every:
            return False
        self.learner.reset_reference()
        return True

    def evaluate_heldout(self, tasks: list[TaskRecord], samples: int = 1, temperature: float | None = None) -> dict:
        """``samples`` rollouts per held-out task at ``temperature`` (default ``evaluation.temperature``)
        on the replica's first model-parallel rank, shared with the others; summaries by slice, each
        over every rollout of its tasks."""
        from nemo_orchestra.evaluation.heldout import breakdown

        temperature = self.cfg.evaluation.temperature if temperature is None else temperature
        rng = rng_state()  # an in-process engine samples from torch's generator: training's draws stay as they were
        play = lambda: self.rollouts.episodes.run(tasks, samples, temperature, HELDOUT_SEED, self.step)  # noqa: E731
        trajs = broadcast_in_model_parallel_group(on_rollout_rank(self.generation, play))
        set_rng_state(rng)
        result = breakdown(trajs)
        log.info(
            "held-out at step %d: accuracy %.3f, mean cost $%.6f over %d tasks%s",
            self.step,
            result["all"]["accuracy"],
            result["all"]["cost_mean"],
            len(tasks),
            f" x {samples} samples at temperature {temperature:g}" if samples > 1 else "",
        )
        return result

    # ---- the run ------------------------------------------------------------------------------------------
    def mark_plans(self, trajs: list[Trajectory]) -> None:
        """With ``loss.restatement_coef``: the one-token plans of ``trajs`` whose restatement trains
        (``Trajectory.plans``). The first batch with none says once that the term trains nothing."""
        if self.cfg.loss.restatement_coef <= 0:
            return
        for t in trajs:
            t.plans = plan_positions(t, self.rollouts.episodes.chat)
        if trajs and not any(t.plans for t in trajs) and not self.plans_unseen_said:
            self.plans_unseen_said = True
            log.warning(
                "loss.restatement_coef=%g trains nothing here: no turn opens with a one-token plan of the default "
                "task set (the embedded tokenizer's, on tasks with a kind and a preference profile); set it to 0",
                self.cfg.loss.restatement_coef,
            )

    def warm_start(self) -> None:
        """The warm start (``train/warm_start.py``); then the engine gets the warm-started weights."""
        self.mark_plans(self.warm_start_trajectories + self.copy_lessons)
        run_warm_start(self.learner, self.cfg, self.plan, self.warm_start_trajectories, self.copy_lessons, self.rank)
        self.sync_weights(self.step)

    def resume(self, ckpt_root: str) -> bool:
        try:  # the newest intact checkpoint; a run with only damaged ones stops, naming the bad file
            folder = latest_checkpoint(ckpt_root)
        except CheckpointError as e:
            raise SystemExit(f"error: cannot resume: {e}") from None
        if folder is None:
            return False
        state = load_checkpoint(folder, self.learner, self.rank)
        self.step = state["step"]
        self.rollouts.order.resume(self.step, state.get("data_position"))
        rng = rng_state()
        self.sync_weights(self.step)  # may start the engine, whose construction draws random numbers
        set_rng_state(rng)  # the checkpoint's: the next step samples as the uninterrupted run's did
        log.info("resumed from %s at step %d", folder, self.step)
        return True

    def fit(self, ckpt_root: str, stop: Callable[[], bool] = lambda: False) -> None:
        """GRPO steps up to ``trainer.max_steps``, or until ``stop()`` is true on any rank after a step.
        Checkpoints by ``checkpoint.save_every`` / ``save_every_s``, at the last step and when stopping."""
        from tqdm import tqdm

        c = self.cfg.checkpoint
        schedule = SaveSchedule(c.save_every, c.save_every_s, self.cfg.trainer.max_steps, last_saved=self.step)
        bar = tqdm(
            total=self.cfg.trainer.max_steps, initial=self.step, desc="grpo", disable=self.rank != 0, dynamic_ncols=True
        )
        try:
            self._fit_steps(ckpt_root, bar, schedule, stop)
        finally:
            self.rollouts.stop()
        bar.close()

    def _fit_steps(self, ckpt_root: str, bar, schedule: SaveSchedule, stop: Callable[[], bool]) -> None:
        while self.step < self.cfg.trainer.max_steps:
            metrics = self.guarded_step(ckpt_root, schedule)
            self.step += 1
            self.logger.log(self.step, metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{metrics['reward/outcome']:.2f}")
            stopping, by_time = agree([stop(), schedule.by_time()], self.learner.device)
            if schedule.by_step(self.step) or by_time or stopping:
                self.save(ckpt_root)
                schedule.saved(self.step)
            if stopping:
                break

    def guarded_step(self, ckpt_root: str, schedule: SaveSchedule) -> dict:
        """``grpo_step()``; if it raises (an error, or a signal that drops the step) before touching the
        weights, the last completed step is saved first when it is not yet (one process: a save is
        collective), with the RNG state it had, so that a resumed run redoes this step exactly."""
        versions, rng = param_versions(self.learner.module), rng_state()
        try:
            return self.grpo_step()
        except BaseException:
            alone = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
            if alone and self.step > schedule.last_saved and param_versions(self.learner.module) == versions:
                log.warning("step %d did not finish: saving step %d, the last completed one", self.step + 1, self.step)
                self.save(ckpt_root, rng)
            raise

    def save(self, ckpt_root: str, rng: dict | None = None) -> str:
        order = self.rollouts.order
        return save_checkpoint(
            ckpt_root,
            self.step,
            self.learner,
            {"data_position": order.position(self.step).to_dict(), "data_parallel_size": order.dp_size},
            self.cfg.checkpoint.keep,
            self.rank,
            self.cfg.model,
            self.vocab_size,
            rng=rng,
        )

    def close(self) -> None:
        try:
            self.rollouts.stop()
            self.logger.close()
            close_loop(self.loop, self.client)
        finally:  # engines with processes of their own (vllm) are shut down whatever happened before
            self.generation.close()


def close_loop(loop: asyncio.AbstractEventLoop, client) -> None:
    """Cancel what is still running on ``loop`` (a stop signal leaves a gather's other tasks pending),
    let it finish, then close the client and the loop: a task closed with its loop would run its
    clean-up on a closed loop and print a traceback for each."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(client.aclose())
    loop.close()
