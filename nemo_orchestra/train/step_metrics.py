"""What a GRPO step reports beside its loss: the rollouts' figures (``rollout_metrics``), the engine's and
the trainer's times (``timing_metrics``), the logprob + train stage's FLOPs and MFU (``train_perf``), the
policy gradient's variance (``gradient_variance``) and a few decoded rollouts (``write_samples``)."""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from nemo_orchestra.config import Config
from nemo_orchestra.megatron.forward import selects_last_layer_rows
from nemo_orchestra.megatron.parallel import data_parallel_sum
from nemo_orchestra.prompting.chat import ChatFormat
from nemo_orchestra.train.flops import forward_flops, perf_metrics, sequence_layout
from nemo_orchestra.train.grad_variance import policy_gradient_variance
from nemo_orchestra.train.learner import Learner
from nemo_orchestra.train.rollout_source import StepRollouts
from nemo_orchestra.types import PackedBatch, Trajectory


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    mean = statistics.fmean
    n_calls = sum(sum(t.tool_counts.values()) for t in trajs) or 1
    out = {
        "reward/mean": mean(t.reward for t in trajs),
        "reward/outcome": mean(float(t.correct) for t in trajs),
        "rollout/cost_mean": mean(t.cost for t in trajs),
        "rollout/tool_cost_mean": mean(t.tool_cost for t in trajs),
        "rollout/latency_mean": mean(t.latency_s for t in trajs),
        "rollout/turns_mean": mean(len(t.turns) for t in trajs),
        "rollout/length_mean": mean(len(t.token_ids) for t in trajs),
        "rollout/tool_error_rate": sum(t.tool_errors for t in trajs) / max(sum(len(t.turns) for t in trajs), 1),
        "rollout/format_error_rate": sum(t.format_errors for t in trajs) / max(sum(len(t.turns) for t in trajs), 1),
        "rollout/schema_error_rate": sum(t.schema_errors for t in trajs) / max(sum(len(t.turns) for t in trajs), 1),
        "rollout/plan_error_rate": sum(t.plan_errors for t in trajs) / max(sum(len(t.turns) for t in trajs), 1),
        # turns a server would re-tokenize to other ids (same text): the share served is not token-exact
        "rollout/retokenized_turn_rate": sum(t.retokenized_turns for t in trajs)
        / max(sum(len(t.turns) for t in trajs), 1),
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
    by_kind: dict[str, list[Trajectory]] = {}  # the dearest expert's reach per category and profile
    for t in trajs:
        if "preference_name" in t.task.meta:
            by_kind.setdefault(f"{t.task.category}/{t.task.meta['preference_name']}", []).append(t)
    for kind, group in sorted(by_kind.items()):  # the share of rollouts that call expert-large at least once
        out[f"rollout/large_rollouts/{kind}"] = mean(float(t.tool_counts.get("expert-large", 0) > 0) for t in group)
    return out


def rollout_timing(rollouts: StepRollouts, step_start: float, step_s: float) -> dict[str, float]:
    """The generation engine's share of the rollout and its idle wait on tools (with rollouts running
    ahead, these overlap training: the trainer's own wait is time/rollout_wait_s)."""
    stats, waited = rollouts.stats, rollouts.waited_s
    return {
        "time/generate_s": stats["generate_s"],
        "time/env_wait_s": stats["env_wait_s"],
        "rollout/generate_calls": stats["generate_calls"],
        "rollout/prompts_drawn": stats["prompts_drawn"],
        "time/rollouts_wall_s": stats["wall_s"],
        "time/rollout_wait_s": waited,
        "perf/rollout_wait_share": waited / step_s,
        # when the step's rollouts were started and done, in seconds since the step began (negative:
        # before it; started before it when they ran ahead)
        "time/rollouts_started_s": rollouts.started_at - step_start,
        "time/rollouts_finished_s": rollouts.finished_at - step_start,
    }


def train_perf(
    learner: Learner, cfg: Config, vocab_size: int, reference_pass: bool, batches: list[PackedBatch], seconds: float
) -> dict:
    """perf/tflops_per_gpu, perf/mfu, perf/peak_mem_gb of the logprob + train stage (see flops.py)."""
    seqs, prefixes, rows = sequence_layout(batches)
    passes = 3 + reference_pass  # forward + backward, and the reference's logprobs
    logit_tokens = sum(len(r) for r in rows)  # the LM head's rows (logits_at)
    last_rows = rows if selects_last_layer_rows(learner.model) else None
    flops = forward_flops(cfg.model, vocab_size, seqs, logit_tokens, prefixes, last_rows)
    flops = data_parallel_sum([passes * flops])[0]
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return perf_metrics(flops, seconds, world, cfg.perf.peak_tflops)


def gradient_variance(
    learner: Learner, cfg: Config, kept: list[Trajectory], rollouts: list[Trajectory]
) -> dict[str, float]:
    """``grad/pg_*`` of this step's trained rollouts under both credits (``train/grad_variance.py``); the
    per-turn baselines from all its ``rollouts``, as training computes them."""
    t0 = time.perf_counter()
    out = policy_gradient_variance(
        learner,
        kept,
        cfg.advantage,
        cfg.reward,
        cfg.parallel,
        cfg.share_prompts,
        cfg.rollout.temperature,
        peers=rollouts,
    )
    out["time/grad_variance_s"] = time.perf_counter() - t0
    return out


def write_samples(output_dir: str, chat: ChatFormat, step: int, trajs: list[Trajectory], n: int = 2) -> None:
    """A few decoded rollouts of GRPO step ``step`` (counted from 1) in ``samples.jsonl``, to read what the
    policy does (the caller's first rank only)."""
    with open(os.path.join(output_dir, "samples.jsonl"), "a") as f:
        for t in trajs[:n]:
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "task_id": t.task.id,
                        "category": t.task.category,
                        "answer": t.task.answer,
                        "correct": t.correct,
                        "stop": t.stop_reason,
                        "text": chat.decode(t.token_ids[t.prompt_len :]),
                    }
                )
                + "\n"
            )
