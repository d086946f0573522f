"""The GRPO loop: each step is a sequence of short named stages.

rollout -> reward -> advantages -> pack -> logprobs (old, reference) -> train -> sync -> log -> checkpoint

With ``rollout.steps_ahead=K >= 1`` the rollouts of the next K steps run while a step trains
(``train/async_rollouts.py``); with K = 0 a step's rollouts run when it starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from nemo_orchestra.config import Config
from nemo_orchestra.grpo.advantages import assign_advantages, informative_groups
from nemo_orchestra.grpo.reward import assign_rewards
from nemo_orchestra.export.qwen3 import full_state_dict
from nemo_orchestra.megatron.forward import selects_last_layer_rows
from nemo_orchestra.rollout.managed_engine import ManagedEngine
from nemo_orchestra.megatron.parallel import (
    broadcast_in_model_parallel_group,
    data_parallel_gather,
    data_parallel_sum,
    model_parallel_rank,
)
from nemo_orchestra.prompting.chat import ChatFormat
from nemo_orchestra.rollout.loop import HELDOUT_SEED, EnginePolicy, LoopLimits, run_episodes
from nemo_orchestra.train.async_rollouts import AsyncRollouts
from nemo_orchestra.train.data_order import DataPosition, rank_indices
from nemo_orchestra.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from nemo_orchestra.train.flops import forward_flops, perf_metrics, sequence_layout
from nemo_orchestra.train.grad_variance import policy_gradient_variance
from nemo_orchestra.train.metric_logger import MetricLogger
from nemo_orchestra.train.run_plan import RunPlan
from nemo_orchestra.train.policy import Policy, reset_optimizer_state, set_lr
from nemo_orchestra.runtime.run_control import SaveSchedule, agree, param_versions
from nemo_orchestra.train.step import (
    ReferenceAhead,
    grpo_update,
    minibatch_packs,
    pack_for_step,
    reference_logprobs,
    warm_start_loss_fn,
    train_step,
)
from nemo_orchestra.types import PackedBatch, TaskRecord, Trajectory
from tools_env.recovery import restarts as tool_service_restarts, tool_service_context, with_tool_service

log = logging.getLogger(__name__)

# a wait for a step's rollouts longer than this: the engine is behind the trainer (Trainer.reference_ahead)
ENGINE_BEHIND_S = 0.05


@dataclass
class Trainer:
    cfg: Config
    policy: Policy
    generation: ManagedEngine  # the generation engine, from its start to its close
    client: object  # tools_env client
    chat: ChatFormat
    tasks: list[TaskRecord]
    logger: MetricLogger
    tokenizer: object = None
    vocab_size: int = 0
    warm_start_trajectories: list[Trajectory] = field(default_factory=list)  # scripted warm-start data
    copy_lessons: list[Trajectory] = field(default_factory=list)  # warm-start copy lessons (data.warm_start)
    rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    step: int = 0
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    plan: RunPlan | None = None  # settings derived from the config and the machine (made here when None)
    rollouts: AsyncRollouts | None = None  # rollouts running ahead of training (plan.rollouts_ahead > 0)
    # (step, its data position): a fresh run's start, or the resumed checkpoint's
    data_start: tuple[int, DataPosition] = (0, DataPosition())

    def __post_init__(self):
        if self.plan is None:
            self.plan = RunPlan.make(self.cfg, self.policy.device if self.policy else torch.device("cpu"))

    @property
    def engine(self):
        """The generation engine (None until it starts; see ``ManagedEngine``)."""
        return self.generation.engine

    # ---- data order: a seeded permutation per epoch (train/data_order.py) ----------------------------
    def data_position(self, step: int) -> DataPosition:
        """Where step ``step`` draws its prompts: ``data_start`` advanced by the steps since it."""
        n = self.cfg.data.prompts_per_step
        if len(self.tasks) < n * self.dp_size:
            raise ValueError(
                f"data: {len(self.tasks)} tasks are fewer than one step's "
                f"{n} prompts x {self.dp_size} data-parallel ranks"
            )
        base_step, base = self.data_start
        return base.advance(step - base_step, len(self.tasks), n * self.dp_size)

    def batch_tasks(self, step: int) -> list[TaskRecord]:
        pos = self.data_position(step)
        n = self.cfg.data.prompts_per_step
        idx = rank_indices(pos, len(self.tasks), n, self.dp_size, self.dp_rank, self.cfg.run.seed)
        return [self.tasks[i] for i in idx]

    # ---- stages ---------------------------------------------------------------------------------------
    def run_loop(
        self, tasks: list[TaskRecord], samples: int, temperature: float, seed: str = "", stats: dict | None = None
    ) -> list[Trajectory]:
        """``samples`` episodes per task through the agent loop, the engine as the policy."""
        return with_tool_service(
            lambda: self.loop.run_until_complete(self.episodes(tasks, samples, temperature, seed, stats)),
            self.client,
            **tool_service_context(self.cfg.run.output_dir, self.step, seed == HELDOUT_SEED),
        )

    async def episodes(
        self,
        tasks: list[TaskRecord],
        samples: int,
        temperature: float,
        seed: str,
        stats: dict | None = None,
        priority: float = -math.inf,
    ) -> list[Trajectory]:
        """``priority``: the place of their engine calls (``EngineThread``): the step, for a step's
        rollouts (the oldest step's go first); -inf for calls the trainer waits on now."""
        r = self.cfg.rollout
        policy = EnginePolicy(
            self.engine,
            self.chat,
            r.max_new_tokens_per_turn,
            temperature,
            r.top_p,
            weights=self.generation.weights,
            priority=priority,
            seed_per_turn=r.seed_per_turn,
        )
        return await run_episodes(
            tasks,
            policy,
            self.client,
            samples=samples,
            limits=LoopLimits.from_rollout(r),
            default_preference=self.cfg.reward.default_preference,
            seed=seed,
            stats=stats,
        )

    async def step_rollouts(self, step: int) -> tuple[list[Trajectory], dict]:
        """Step ``step``'s rollouts (group_size per prompt), each with its reward, and the engine's
        timings; with ``rollout.fill_informative_groups``, more prompts until the step has
        ``data.prompts_per_step`` groups whose rewards differ (DAPO's dynamic sampling), at most
        ``rollout.max_extra_prompts``. Rewards are computed once, here, as each group comes back."""
        r = self.cfg.rollout
        seed = f"{self.cfg.run.seed}/{step}/{self.dp_rank}"
        tasks = self.batch_tasks(step)
        stats: dict = {}
        t0 = time.perf_counter()
        trajs = await self.episodes(tasks, r.group_size, r.temperature, seed, stats, priority=step)
        assign_rewards(trajs, self.cfg.reward)
        drawn = await self.fill_informative_groups(tasks, trajs, seed, stats, step) if r.fill_informative_groups else 0
        stats["prompts_drawn"] = len(tasks) + drawn
        stats["wall_s"] = time.perf_counter() - t0
        return trajs, stats

    async def fill_informative_groups(
        self, tasks: list[TaskRecord], trajs: list[Trajectory], seed: str, stats: dict, step: int
    ) -> int:
        """More prompts (appended to ``trajs``, their timings to ``stats``) until ``data.prompts_per_step``
        groups are informative or ``rollout.max_extra_prompts`` are drawn; returns how many were drawn.
        The extra prompts are a fixed draw per step, so the data order holds."""
        r, n = self.cfg.rollout, self.cfg.data.prompts_per_step
        used = {t.id for t in tasks}
        pool = [t for t in self.tasks if t.id not in used]
        random.Random(f"{seed}/extra").shuffle(pool)
        drawn = 0
        while drawn < min(r.max_extra_prompts, len(pool)):
            need = n - len(informative_groups(trajs, self.cfg.advantage.min_group_std))
            if need <= 0:
                break
            extra = pool[drawn : drawn + min(need, r.max_extra_prompts - drawn)]
            more_stats: dict = {}
            more = await self.episodes(
                extra, r.group_size, r.temperature, f"{seed}/extra{drawn}", more_stats, priority=step
            )
            offset = max(t.group for t in trajs) + 1
            for t in more:
                t.group += offset
            assign_rewards(more, self.cfg.reward)
            trajs += more
            drawn += len(extra)
            for k, v in more_stats.items():
                stats[k] += v
        return drawn

    def take_rollouts(self) -> tuple[list[Trajectory], dict, float]:
        """This step's rollouts, their engine timings and the seconds the trainer waited for them."""
        context = tool_service_context(self.cfg.run.output_dir, self.step)
        if self.rollouts is None and self.plan.rollouts_ahead > 0:
            assert self.engine is not None and not self.generation.reads_policy_weights, (
                "rollout.steps_ahead > 0 needs an engine with its own weights (checked by the config)"
            )
            self.rollouts = AsyncRollouts(
                self.loop, self.step_rollouts, self.plan.rollouts_ahead, self.cfg.trainer.max_steps
            )
        if self.rollouts is None:
            t0 = time.perf_counter()
            trajs, stats = with_tool_service(
                lambda: self.loop.run_until_complete(self.step_rollouts(self.step)), self.client, **context
            )
            stats["started_at"], stats["finished_at"] = t0, time.perf_counter()
            return trajs, stats, stats["finished_at"] - t0
        (trajs, stats), waited = with_tool_service(lambda: self.rollouts.take(self.step), self.client, **context)
        stats["started_at"], stats["finished_at"] = self.rollouts.started[self.step], self.rollouts.finished[self.step]
        return trajs, stats, waited

    def stop_rollouts_ahead(self) -> None:
        """Drop the rollouts in flight for later steps; the event loop is this thread's again."""
        if self.rollouts is not None:
            self.rollouts.close()
            self.rollouts = None

    def drop_stale(self, trajs: list[Trajectory]) -> tuple[list[Trajectory], dict[str, float]]:
        """Trajectories whose oldest turn is at most ``rollout.steps_ahead`` versions behind this step's
        policy (all of them, by construction: a violation is counted, and the trajectory not trained on)."""
        lags = [self.step - min(t.turn_versions, default=self.step) for t in trajs]
        k = self.plan.rollouts_ahead
        kept = [t for t, lag in zip(trajs, lags) if lag <= k]
        return kept, {
            "rollout/staleness_mean": statistics.fmean(lags) if lags else 0.0,
            "rollout/staleness_max": float(max(lags, default=0)),
            "rollout/stale_dropped": float(len(trajs) - len(kept)),
        }

    def on_rollout_rank(self, fn):
        """``fn()`` (rollouts) on this replica's first model-parallel rank; None on the others.

        An engine whose forward spans the tensor-parallel group (rollout.engine=megatron at TP > 1)
        has the other ranks serve its generate calls meanwhile, until the first rank releases them.
        """
        spans = self.generation.spans_tensor_parallel_group
        if model_parallel_rank() != 0:
            if spans:
                self.engine.serve()
            return None
        try:
            return fn()
        finally:
            if spans:
                self.engine.release()

    def fill_logprobs(self, batches: list[PackedBatch]) -> dict[str, float]:
        """The frozen reference's logprobs, for the KL term (none when ``loss.kl_coef`` is 0). The old
        logprobs are the update's (see grpo_update)."""
        if not self.plan.reference_pass:
            return {"time/ref_logprobs_s": 0.0}
        t0 = time.perf_counter()
        for b, r in zip(batches, reference_logprobs(self.policy, batches, self.cfg.rollout.temperature)):
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
        return ReferenceAhead(self.policy, batches, self.cfg.rollout.temperature, torch.get_num_threads(), idle=idle)

    def train_perf(self, batches: list[PackedBatch], seconds: float) -> dict:
        """perf/tflops_per_gpu, perf/mfu, perf/peak_mem_gb of the logprob + train stage (see flops.py)."""
        seqs, prefixes, rows = sequence_layout(batches)
        passes = 3 + self.plan.reference_pass  # forward + backward, and the reference's logprobs
        logit_tokens = sum(len(r) for r in rows)  # the LM head's rows (logits_at)
        last_rows = rows if selects_last_layer_rows(self.policy.model) else None
        flops = forward_flops(self.cfg.model, self.vocab_size, seqs, logit_tokens, prefixes, last_rows)
        flops = data_parallel_sum([passes * flops])[0]
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return perf_metrics(flops, seconds, world, self.cfg.perf.peak_tflops)

    def gradient_variance(self, kept: list[Trajectory], rollouts: list[Trajectory]) -> dict[str, float]:
        """``grad/pg_*`` of this step's trained rollouts under both credits (``train/grad_variance.py``); the
        per-turn baselines from all its ``rollouts``, as training computes them."""
        t0 = time.perf_counter()
        out = policy_gradient_variance(
            self.policy,
            kept,
            self.cfg.advantage,
            self.cfg.reward,
            self.cfg.parallel,
            self.cfg.share_prompts,
            self.cfg.rollout.temperature,
            peers=rollouts,
        )
        out["time/grad_variance_s"] = time.perf_counter() - t0
        return out

    def sync_weights(self, version: int) -> float:
        """The policy's weights after ``version`` GRPO steps into the engine (``ManagedEngine.sync``)."""
        return self.generation.sync(lambda: full_state_dict(self.policy.module), version)

    def engine_memory(self, action: str) -> float:
        """``sleep`` or ``wake_up`` (``ManagedEngine.memory``)."""
        return self.generation.memory(action, rollouts_ahead=self.rollouts is not None)

    def grpo_step(self) -> dict:
        t0 = time.perf_counter()
        tasks = self.batch_tasks(self.step)
        # one rollout per model replica: its tensor/pipeline ranks must train on the same data
        trajs, stats, waited = broadcast_in_model_parallel_group(self.on_rollout_rank(self.take_rollouts))
        t_rollout = time.perf_counter() - t0
        t_sleep = self.engine_memory("sleep")  # the engine's GPU memory is the trainer's until the sync
        self.write_samples(trajs)  # rewards: assigned as the rollouts came back (step_rollouts)
        fresh, stale_metrics = self.drop_stale(trajs)
        kept, metrics = assign_advantages(fresh, self.cfg.advantage, self.policy.device, self.cfg.reward)
        every = self.cfg.advantage.grad_variance_every
        if every and self.step % every == 0:
            metrics.update(self.gradient_variance(kept, fresh))
        lessons = self.step_lessons(self.step)
        kept = interleave(kept, lessons)  # lessons in every minibatch of the update
        metrics["train/lessons"] = float(len(lessons))
        metrics.update(stale_metrics)
        metrics.update(rollout_metrics(trajs))
        t1 = time.perf_counter()
        minibatches = minibatch_packs(kept, self.cfg.loss.minibatches, self.cfg.parallel, self.cfg.share_prompts)
        batches = [b for mb in minibatches for b in mb]
        if batches:
            ahead = self.reference_ahead(batches, waited)
            if ahead is None:
                metrics.update(self.fill_logprobs(batches))
            t2 = time.perf_counter()
            self.policy.guard.step = self.step  # grpo_update begins step self.step + 1 (the one a message names)
            try:
                metrics.update(grpo_update(self.policy, minibatches, self.cfg.loss, self.cfg.rollout.temperature))
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
        else:
            metrics["train/step_skipped"] = 1.0
        t_train = time.perf_counter() - t1
        metrics.update(self.train_perf(batches, t_train))
        metrics["data/task_ids"] = [i for ids in data_parallel_gather([t.id for t in tasks]) for i in ids]
        t_wake = self.engine_memory("wake_up")
        t_sync = self.sync_weights(self.step + 1)
        step_s = time.perf_counter() - t0
        tokens = sum(len(t.token_ids) for t in trajs)
        # the generation engine's share of the rollout and its idle wait on tools (with rollouts running
        # ahead, these overlap training: the trainer's own wait is time/rollout_wait_s)
        metrics.update(
            {
                "time/generate_s": stats["generate_s"],
                "time/env_wait_s": stats["env_wait_s"],
                "rollout/generate_calls": stats["generate_calls"],
                "rollout/prompts_drawn": stats["prompts_drawn"],
                "time/rollouts_wall_s": stats["wall_s"],
                "time/rollout_wait_s": waited,
                "perf/rollout_wait_share": waited / step_s,
                # when the step's rollouts were started and done, in seconds since the step began (negative:
                # before it; started before it when they ran ahead)
                "time/rollouts_started_s": stats["started_at"] - t0,
                "time/rollouts_finished_s": stats["finished_at"] - t0,
            }
        )
        reset = self.reset_reference_if_due(self.step + 1)  # after the weight sync: the reference thread has joined
        metrics["train/reference_reset"] = float(reset)
        metrics.update({"time/engine_sleep_s": t_sleep, "time/engine_wake_s": t_wake})
        metrics["tools_env/restarts"] = float(tool_service_restarts(self.client))
        metrics.update(
            {
                "time/rollout_s": t_rollout,
                "time/train_s": t_train,
                "time/weight_sync_s": t_sync,
                "time/step_s": step_s,
                "perf/tokens_per_s": tokens / step_s,
                "perf/generated_tokens": sum(t.num_generated for t in trajs),
            }
        )
        return metrics

    def reset_reference_if_due(self, step: int) -> bool:
        """After GRPO step ``step`` (counted from 1): every ``reference.reset_every`` steps the KL reference
        becomes a copy of the updated policy (ProRL's reference reset, Liu et al. 2025), so the KL holds
        each stretch of steps near where it began rather than the whole run near the warm start. Returns
        whether it was reset. The checkpoint saved after the step holds the new reference."""
        every = self.cfg.reference.reset_every
        if not every or step % every:
            return False
        self.policy.reset_reference()
        return True

    def step_lessons(self, step: int) -> list[Trajectory]:
        """``loss.copy_lessons_per_step`` of the warm start's copy lessons for this step and data-parallel
        rank (none with ``loss.copy_lesson_coef`` 0 or a run without lessons), each with the coefficient as
        its advantage: the update adds that multiple of their log-likelihood's gradient. Their calls
        are trained, not their plans, so they hold the call format and the copying that the plans'
        updates would otherwise wear away, without pulling the choice of tool. Drawn from
        (seed, step, rank), so a resumed run draws the same."""
        coef, n = self.cfg.loss.copy_lesson_coef, self.cfg.loss.copy_lessons_per_step
        if coef <= 0 or n <= 0 or not self.copy_lessons:
            return []
        rng = random.Random(f"{self.cfg.run.seed}/lessons/{step}/{self.dp_rank}")
        picked = rng.sample(range(len(self.copy_lessons)), min(n, len(self.copy_lessons)))
        return [
            replace(self.copy_lessons[i], advantage=coef, meta={**self.copy_lessons[i].meta, "lesson": True})
            for i in picked
        ]

    def write_samples(self, trajs: list[Trajectory], n: int = 2) -> None:
        """A few decoded rollouts per step in ``samples.jsonl``, to read what the policy does."""
        if self.rank != 0:
            return
        with open(os.path.join(self.cfg.run.output_dir, "samples.jsonl"), "a") as f:
            for t in trajs[:n]:
                f.write(
                    json.dumps(
                        {
                            "step": self.step + 1,
                            "task_id": t.task.id,
                            "category": t.task.category,
                            "answer": t.task.answer,
                            "correct": t.correct,
                            "stop": t.stop_reason,
                            "text": self.chat.decode(t.token_ids[t.prompt_len :]),
                        }
                    )
                    + "\n"
                )

    def evaluate_heldout(self, tasks: list[TaskRecord], samples: int = 1, temperature: float | None = None) -> dict:
        """``samples`` rollouts per held-out task at ``temperature`` (default ``evaluation.temperature``)
        on the replica's first model-parallel rank, shared with the others; summaries by slice, each
        over every rollout of its tasks."""
        from nemo_orchestra.evaluation.heldout import breakdown

        temperature = self.cfg.evaluation.temperature if temperature is None else temperature
        rng = rng_state()  # an in-process engine samples from torch's generator: training's draws stay as they were
        trajs = broadcast_in_model_parallel_group(
            self.on_rollout_rank(lambda: self.run_loop(tasks, samples, temperature, seed=HELDOUT_SEED))
        )
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

    # ---- warm start -------------------------------------------------------------------------------------
    def warm_start(self) -> None:
        """SFT on the scripted trajectories (unless the policy starts from ``model.init_from``), then
        the reference policy becomes the warm-started one."""
        ws, warm_start_trajs = self.cfg.warm_start, self.warm_start_trajectories
        if self.cfg.model.init_from and ws.steps > 0:
            log.info("warm start skipped: the policy starts from model.init_from=%s", self.cfg.model.init_from)
        elif ws.steps > 0:
            if not warm_start_trajs:
                raise RuntimeError("warm start: no scripted episodes were made (build_trainer, resume_from)")
            set_lr(self.policy.optimizer, ws.lr)
            from tqdm import tqdm

            rng = random.Random(self.cfg.run.seed)
            bar = tqdm(range(ws.steps), desc="warm start", disable=self.rank != 0, dynamic_ncols=True)
            for i in bar:
                set_lr(self.policy.optimizer, cosine_lr(ws.lr, ws.min_lr_ratio, i, ws.steps))
                batch = rng.sample(warm_start_trajs, min(ws.batch_size, len(warm_start_trajs)))
                batch += rng.sample(self.copy_lessons, min(ws.copy_lessons_per_step, len(self.copy_lessons)))
                m = train_step(
                    self.policy, pack_for_step(batch, self.cfg.parallel, self.cfg.share_prompts), warm_start_loss_fn
                )
                bar.set_postfix(nll=f"{m.get('loss/nll', float('nan')):.3f}")
            log.info("warm start done: %d steps, nll %.4f", ws.steps, m.get("loss/nll", float("nan")))
            set_lr(self.policy.optimizer, self.cfg.optim.lr)
            reset_optimizer_state(self.policy.optimizer)  # GRPO starts with fresh Adam moments
        self.policy.reset_reference()
        self.sync_weights(self.step)

    # ---- the loop -----------------------------------------------------------------------------------------
    def resume(self, ckpt_root: str) -> bool:
        try:  # the newest intact checkpoint; a run with only damaged ones stops, naming the bad file
            folder = latest_checkpoint(ckpt_root)
        except CheckpointError as e:
            raise SystemExit(f"error: cannot resume: {e}") from None
        if folder is None:
            return False
        state = load_checkpoint(folder, self.policy, self.rank)
        self.step = state["step"]
        n = self.cfg.data.prompts_per_step * self.dp_size
        self.data_start = (self.step, DataPosition.saved(state.get("data_position"), self.step, len(self.tasks), n))
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
            self.stop_rollouts_ahead()
        bar.close()

    def _fit_steps(self, ckpt_root: str, bar, schedule: SaveSchedule, stop: Callable[[], bool]) -> None:
        while self.step < self.cfg.trainer.max_steps:
            metrics = self.guarded_step(ckpt_root, schedule)
            self.step += 1
            self.logger.log(self.step, metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{metrics['reward/outcome']:.2f}")
            stopping, by_time = agree([stop(), schedule.by_time()], self.policy.device)
            if schedule.by_step(self.step) or by_time or stopping:
                self.save(ckpt_root)
                schedule.saved(self.step)
            if stopping:
                break

    def guarded_step(self, ckpt_root: str, schedule: SaveSchedule) -> dict:
        """``grpo_step()``; if it raises (an error, or a signal that drops the step) before touching the
        weights, the last completed step is saved first when it is not yet (one process: a save is
        collective), with the RNG state it had, so that a resumed run redoes this step exactly."""
        versions, rng = param_versions(self.policy.module), rng_state()
        try:
            return self.grpo_step()
        except BaseException:
            alone = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
            if alone and self.step > schedule.last_saved and param_versions(self.policy.module) == versions:
                log.warning("step %d did not finish: saving step %d, the last completed one", self.step + 1, self.step)
                self.save(ckpt_root, rng)
            raise

    def save(self, ckpt_root: str, rng: dict | None = None) -> str:
        return save_checkpoint(
            ckpt_root,
            self.step,
            self.policy,
            {"data_position": self.data_position(self.step).to_dict(), "data_parallel_size": self.dp_size},
            self.cfg.checkpoint.keep,
            self.rank,
            self.cfg.model,
            self.vocab_size,
            rng=rng,
        )

    def close(self) -> None:
        try:
            self.stop_rollouts_ahead()
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


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    mean = statistics.fmean
    n_calls = sum(sum(t.tool_counts.values()) for t in trajs) or 1
    out = {
        "reward/mean": mean(t.reward for t in trajs),
        "reward/outcome": mean(float(t.correct) for t in trajs),
        "rollout/cost_mean": mean(t.cost for t in trajs),
        "rollout/tool_cost_mean": mean(t.tool_cost for t in trajs),
        "rollout/latency_mean": mean(t.latency_s for t in trajs),
        "rollout/turns_mean": mean(t.turns for t in trajs),
        "rollout/length_mean": mean(len(t.token_ids) for t in trajs),
        "rollout/tool_error_rate": sum(t.tool_errors for t in trajs) / max(sum(t.turns for t in trajs), 1),
        "rollout/format_error_rate": sum(t.format_errors for t in trajs) / max(sum(t.turns for t in trajs), 1),
        "rollout/schema_error_rate": sum(t.schema_errors for t in trajs) / max(sum(t.turns for t in trajs), 1),
        # turns a server would re-tokenize to other ids (same text): the share served is not token-exact
        "rollout/retokenized_turn_rate": sum(t.retokenized_turns for t in trajs) / max(sum(t.turns for t in trajs), 1),
        "rollout/answered_rate": mean(float(t.stop_reason == "answer") for t in trajs),
    }
    tools = sorted({k for t in trajs for k in t.tool_counts})
    for k in tools:
        out[f"rollout/tool_share/{k}"] = sum(t.tool_counts.get(k, 0) for t in trajs) / n_calls
    by_profile: dict[str, list[Trajectory]] = {}  # expert choice per preference profile, as it is learned
    for t in trajs:
        if "preference_name" in t.task.meta:
            by_profile.setdefault(t.task.meta["preference_name"], []).append(t)
    for name, group in sorted(by_profile.items()):
        experts = {k: sum(t.tool_counts.get(k, 0) for t in group) for k in tools if k.startswith("expert-")}
        total = sum(experts.values())  # 0: this profile made no expert call this step, which says nothing
        out.update({f"rollout/expert_share/{name}/{k}": v / total for k, v in experts.items() if total})
    return out
