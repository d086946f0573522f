"""Typed configuration: YAML base file + group files + ``key=value`` overrides.

``conf/grpo_orchestrator.yaml`` holds every key with its default and a ``defaults`` table naming
one file per group (``conf/<group>/<name>.yaml``, holding that section's keys). The dataclasses
below are the schema: they declare types, the YAML declares values, and ``load_config`` merges
the two so that an unknown key, a wrong type or a bad value is an error naming the key.
Library code receives these objects; only recipes call ``load_config``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, TypeVar

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_orchestra.rollout.engine_registry import ENGINES  # data only: no engine is imported

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("model", "parallel", "reward", "tools")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "te")
PARAMS_DTYPES = ("fp32", "bf16", "fp16")  # megatron.model.DTYPES maps each to its torch dtype (asserted there)
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration mistake; the message names the key."""


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


@dataclass
class RunConfig:
    output_dir: str = MISSING
    seed: int = MISSING
    log_level: str = MISSING  # DEBUG shows every third-party notice the console otherwise filters
    resume: bool = MISSING  # false: start afresh, removing the folder's checkpoints and records
    max_restarts: int = MISSING  # requeues after the preempt signal (Slurm, scripts/requeue_local.py)
    preempt_signal: Optional[str] = MISSING  # checkpoint, stop and ask to be requeued; null: none
    stall_timeout_s: Optional[float] = MISSING  # a rank silent this long ends the run (runtime/watchdog.py)

    def validate(self) -> None:
        _check(
            self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"),
            "run.log_level",
            "must be DEBUG, INFO, WARNING or ERROR",
        )
        _check(self.max_restarts >= 0, "run.max_restarts", "must be >= 0")
        _check(self.stall_timeout_s is None or self.stall_timeout_s > 0, "run.stall_timeout_s", "must be > 0 or null")
        _check(
            self.preempt_signal is None
            or self.preempt_signal.upper().removeprefix("SIG") in ("USR1", "USR2", "HUP", "URG"),
            "run.preempt_signal",
            "must be null, USR1, USR2, HUP or URG",
        )


@dataclass
class ModelConfig:
    name: str = MISSING
    vocab_size: Optional[int] = MISSING  # null: taken from the tokenizer
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: int = MISSING
    head_dim: int = MISSING
    ffn_hidden_size: int = MISSING
    rope_theta: float = MISSING
    norm_eps: float = MISSING
    tie_embeddings: bool = MISSING
    max_position_embeddings: int = MISSING
    init_std: float = MISSING
    attention_backend: str = MISSING
    params_dtype: str = MISSING
    fp8: Optional[str] = MISSING  # null | hybrid | e4m3 (TransformerEngine)
    fp8_recipe: str = MISSING  # delayed | tensorwise (current scaling)
    qk_norm: bool = MISSING  # RMSNorm on queries and keys per head (Qwen3: true, Llama: false)
    init_from: Optional[str] = MISSING  # a local HF folder or a nemo-orchestra checkpoint folder
    tokenizer: Optional[str] = MISSING  # null: build the embedded tokenizer
    chat_template: str = MISSING  # auto | tokenizer | prefix | a .jinja file (prompting.chat)
    enable_thinking: Optional[bool] = MISSING  # the template variable; null: the template's default
    reasoning_parser: bool = MISSING  # the model is served with a reasoning parser (turns must survive it too)

    def validate(self) -> None:
        for k in (
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "ffn_hidden_size",
            "max_position_embeddings",
        ):
            _check(getattr(self, k) > 0, f"model.{k}", "must be > 0")
        _check(
            self.num_attention_heads % self.num_query_groups == 0,
            "model.num_query_groups",
            "must divide model.num_attention_heads",
        )
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            "model.attention_backend",
            f"must be one of {ATTENTION_BACKENDS}",
        )
        _check(self.params_dtype in PARAMS_DTYPES, "model.params_dtype", "must be fp32, bf16 or fp16")
        _check(
            self.chat_template in ("auto", "tokenizer", "prefix") or self.chat_template.endswith(".jinja"),
            "model.chat_template",
            "must be auto, tokenizer, prefix or a .jinja file",
        )
        _check(self.fp8 in (None, "hybrid", "e4m3"), "model.fp8", "must be null, hybrid or e4m3")
        _check(self.fp8_recipe in ("delayed", "tensorwise"), "model.fp8_recipe", "must be delayed or tensorwise")
        _check(
            self.fp8 is None or self.params_dtype == "bf16",
            "model.fp8",
            "needs model.params_dtype=bf16 (bf16 weights, fp32 master copies in the optimizer)",
        )


@dataclass
class ParallelConfig:
    tp: int = MISSING
    pp: int = MISSING
    distributed_optimizer: bool = MISSING
    sequence_parallel: bool = MISSING
    microbatch_tokens: int = MISSING
    backend: str = MISSING  # auto | nccl | gloo
    activation_recompute: bool = MISSING  # keep each layer's input only; recompute the layer in backward
    collective_timeout_s: float = MISSING  # how long a collective waits for a rank that does not join

    def validate(self) -> None:
        _check(self.tp >= 1, "parallel.tp", "must be >= 1")
        _check(self.pp >= 1, "parallel.pp", "must be >= 1")
        _check(self.microbatch_tokens > 0, "parallel.microbatch_tokens", "must be > 0")
        _check(self.backend in ("auto", "nccl", "gloo"), "parallel.backend", "must be auto, nccl or gloo")
        _check(self.collective_timeout_s > 0, "parallel.collective_timeout_s", "must be > 0")


EMBEDDED_CATEGORIES = ("arithmetic", "lookup", "reasoning", "multistep")  # data/default_tasks.py's


def parse_categories(text: str) -> tuple[str, ...]:
    """``data.categories`` ("arithmetic,lookup") as a tuple of names."""
    return tuple(c.strip() for c in text.split(","))


@dataclass
class DataConfig:
    train_path: Optional[str] = MISSING  # null: generate the embedded default task set
    eval_path: Optional[str] = MISSING
    num_train_tasks: int = MISSING
    num_eval_tasks: int = MISSING
    prompts_per_step: int = MISSING
    categories: str = MISSING  # the embedded task set's categories, comma-separated (data/default_tasks.py)

    def validate(self) -> None:
        names = parse_categories(self.categories)
        unknown = [c for c in names if c not in EMBEDDED_CATEGORIES]
        _check(
            not unknown,
            "data.categories",
            f"unknown {unknown}; the embedded task set has {', '.join(EMBEDDED_CATEGORIES)}",
        )
        _check(len(set(names)) == len(names), "data.categories", "names a category twice")
        _check(self.prompts_per_step >= 1, "data.prompts_per_step", "must be >= 1")
        _check(self.num_train_tasks >= 1, "data.num_train_tasks", "must be >= 1")


@dataclass
class RolloutConfig:
    engine: str = MISSING
    group_size: int = MISSING
    max_turns: int = MISSING
    task_turns: bool = MISSING  # a task record's own max_turns, when it has one, instead of max_turns
    max_new_tokens_per_turn: int = MISSING
    max_context: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    seed_per_turn: bool = MISSING  # each sampled turn draws from its own seed (rollout.loop.turn_seed)
    orchestrator_price_in: float = MISSING  # $/1M tokens the policy itself costs (Qwen3-8B: 0.2)
    orchestrator_price_out: float = MISSING
    sync_timeout_s: float = MISSING  # a weight sync into the engine that takes longer raises (vllm engine)
    batch_window_s: float = MISSING  # once a tool call returns, wait this long for others before generating
    steps_ahead: int = MISSING  # K: rollouts run up to K policy versions ahead of training (0: synchronous)
    fill_informative_groups: bool = (
        MISSING  # sample more prompts until the step has prompts_per_step informative groups
    )
    max_extra_prompts: int = MISSING  # at most this many extra prompts a step when filling informative groups
    gpu_memory_utilization: float = MISSING  # vllm on CUDA: the share of a GPU that training and engine may fill
    kv_cache_gb: Optional[float] = MISSING  # vllm: the engine's KV cache, GiB; null: from the memory plan
    sleep_while_training: bool = MISSING  # vllm on CUDA: weights and KV cache released while training
    cuda_graphs: bool = MISSING  # megatron engines on CUDA at TP=1: decode steps replayed from CUDA graphs

    def validate(self) -> None:
        _check(self.engine in ENGINES, "rollout.engine", f"must be one of {sorted(ENGINES)}")
        _check(self.group_size >= 2, "rollout.group_size", "must be >= 2 (GRPO compares rollouts within a group)")
        _check(self.max_turns >= 1, "rollout.max_turns", "must be >= 1")
        _check(self.max_new_tokens_per_turn >= 1, "rollout.max_new_tokens_per_turn", "must be >= 1")
        _check(self.temperature > 0, "rollout.temperature", "must be > 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        _check(self.sync_timeout_s > 0, "rollout.sync_timeout_s", "must be > 0")
        _check(self.batch_window_s >= 0, "rollout.batch_window_s", "must be >= 0")
        _check(self.steps_ahead >= 0, "rollout.steps_ahead", "must be >= 0 (0: synchronous rollouts)")
        _check(self.max_extra_prompts >= 0, "rollout.max_extra_prompts", "must be >= 0")
        _check(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]")
        _check(self.kv_cache_gb is None or self.kv_cache_gb > 0, "rollout.kv_cache_gb", "must be > 0 or null")


@dataclass
class RewardConfig:
    name: str = MISSING
    use_efficiency: bool = MISSING
    use_preference: bool = MISSING
    scalarization: str = MISSING  # linear | chebyshev
    default_preference: Dict[str, float] = MISSING
    normalize: str = MISSING  # minmax | max: how a group's costs and latencies become utilities
    latency_resolution_s: float = 0.01  # each call's latency counts rounded to this (0: as measured)

    def validate(self) -> None:
        _check(self.scalarization in ("linear", "chebyshev"), "reward.scalarization", "must be linear or chebyshev")
        _check(self.normalize in ("minmax", "max"), "reward.normalize", "must be minmax or max")
        _check(self.latency_resolution_s >= 0, "reward.latency_resolution_s", "must be >= 0 (0: as measured)")
        for k, v in self.default_preference.items():
            _check(v >= 0, f"reward.default_preference.{k}", "must be >= 0")


@dataclass
class AdvantageConfig:
    credit: str = MISSING  # episode: one advantage per rollout; turn: per turn, baselined on the same earlier actions
    mode: str = MISSING
    eps: float = MISSING
    clip: Optional[float] = MISSING
    min_group_std: float = MISSING
    drop_format_errors: bool = MISSING  # rollouts with a malformed call (unparsed or off-schema): out of the loss
    drop_unanswered: bool = MISSING  # rollouts that never called answer: out of the loss
    train_malformed_calls: bool = MISSING  # of a rollout the format filter drops, each malformed turn's broken token
    grad_variance_every: int = MISSING  # N: every N steps, the policy-gradient estimate's variance under both credits

    def validate(self) -> None:
        _check(self.mode in ("std", "mean", "loo"), "advantage.mode", "must be std, mean or loo")
        _check(self.grad_variance_every >= 0, "advantage.grad_variance_every", "must be >= 0 (0: never)")
        _check(self.credit in ("episode", "turn"), "advantage.credit", "must be episode or turn")
        _check(self.clip is None or self.clip > 0, "advantage.clip", "must be null or > 0")


@dataclass
class LossConfig:
    clip_low: float = MISSING
    clip_high: float = MISSING
    dual_clip: Optional[float] = MISSING
    kl_coef: float = MISSING
    tis_cap: Optional[float] = MISSING  # truncated importance sampling cap on trainer/generator ratios; null: off
    minibatches: int = MISSING  # optimizer steps per batch of rollouts (each on 1/N of its trajectories)
    copy_lesson_coef: float = MISSING  # copy lessons in each GRPO step, their log-likelihood at this weight; 0: none
    copy_lessons_per_step: int = MISSING  # copy lessons per step and data-parallel rank
    # each one-token plan's restatement of its task's kind and preference (data.default_tasks.plan_positions), its
    # log-probability summed over the plans that state them right, at this weight; the action stays GRPO's. 0: none
    restatement_coef: float = MISSING

    def validate(self) -> None:
        _check(self.clip_low > 0 and self.clip_high > 0, "loss.clip_low", "clip ranges must be > 0")
        _check(self.minibatches >= 1, "loss.minibatches", "must be >= 1")
        _check(self.dual_clip is None or self.dual_clip > 1, "loss.dual_clip", "must be null or > 1")
        _check(self.kl_coef >= 0, "loss.kl_coef", "must be >= 0")
        _check(self.tis_cap is None or self.tis_cap > 0, "loss.tis_cap", "must be null or > 0")
        _check(self.copy_lesson_coef >= 0, "loss.copy_lesson_coef", "must be >= 0")
        _check(self.copy_lessons_per_step >= 0, "loss.copy_lessons_per_step", "must be >= 0")
        _check(self.restatement_coef >= 0, "loss.restatement_coef", "must be >= 0")


@dataclass
class OptimConfig:
    lr: float = MISSING
    weight_decay: float = MISSING
    adam_beta1: float = MISSING
    adam_beta2: float = MISSING
    adam_eps: float = MISSING
    grad_clip: float = MISSING

    def validate(self) -> None:
        _check(self.lr > 0, "optim.lr", "must be > 0")


@dataclass
class WarmStartConfig:
    steps: int = MISSING  # warm-start steps on synthetic tool-call trajectories; 0 disables
    lr: float = MISSING
    batch_size: int = MISSING
    num_episodes: int = MISSING  # scripted episodes run against the service to make the warm-start data
    copy_lessons: Optional[int] = MISSING  # copy lessons: a tool, then its result copied into the answer
    #   (data.warm_start); null: as many as the warm start draws (steps x copy_lessons_per_step, each seen about
    #   once) with the embedded default task set, none with data.train_path
    copy_lessons_per_step: int = MISSING  # copy lessons in each warm-start batch, besides batch_size scripted episodes
    min_lr_ratio: float = MISSING  # the learning rate decays from lr to lr * this along a cosine
    endpoint_experts: bool = MISSING  # scripted episodes may call experts served by endpoints (which cost money)
    max_calls: int = MISSING  # scripted episodes make 1 to this many tool calls before the answer

    def validate(self) -> None:
        _check(self.steps >= 0, "warm_start.steps", "must be >= 0")
        _check(0.0 <= self.min_lr_ratio <= 1.0, "warm_start.min_lr_ratio", "must be in [0, 1]")
        _check(self.num_episodes >= 1, "warm_start.num_episodes", "must be >= 1")
        _check(self.copy_lessons is None or self.copy_lessons >= 0, "warm_start.copy_lessons", "must be >= 0 or null")
        _check(self.copy_lessons_per_step >= 0, "warm_start.copy_lessons_per_step", "must be >= 0")
        _check(self.max_calls >= 1, "warm_start.max_calls", "must be >= 1")

    def copy_lesson_count(self, train_path: Optional[str]) -> int:
        """How many copy lessons the warm start makes: ``copy_lessons``, or for null as many as it
        draws (``steps x copy_lessons_per_step``, each lesson seen about once) with the embedded default task
        set, and none with a task file; none when the warm start draws none (no steps or
        ``copy_lessons_per_step`` 0), and never more than it draws."""
        draws = self.steps * self.copy_lessons_per_step
        if self.copy_lessons is None:
            return 0 if train_path else draws
        return min(self.copy_lessons, draws)


@dataclass
class TrainerConfig:
    max_steps: int = MISSING
    # optimizer steps skipped in a row for non-finite loss or gradients before the run stops as diverged
    max_skipped_steps: int = MISSING
    kl_warn: Optional[float] = MISSING  # warn once when loss/kl is above this (the policy runs away); null: never

    def validate(self) -> None:
        _check(self.max_steps >= 1, "trainer.max_steps", "must be >= 1")
        _check(self.max_skipped_steps >= 1, "trainer.max_skipped_steps", "must be >= 1")
        _check(self.kl_warn is None or self.kl_warn > 0, "trainer.kl_warn", "must be null or > 0")


@dataclass
class EvaluationConfig:
    enabled: bool = MISSING  # held-out evaluation before and after GRPO, report.md and curves.png
    temperature: float = MISSING  # 0: greedy
    samples: int = MISSING  # and this many per task as GRPO samples (rollout.temperature, top_p); 0: none

    def validate(self) -> None:
        _check(self.temperature >= 0, "evaluation.temperature", "must be >= 0")
        _check(self.samples >= 0, "evaluation.samples", "must be >= 0")


@dataclass
class ReferenceConfig:
    offload: bool = MISSING  # true: the frozen reference lives in CPU memory, swapped in for its forward
    reset_every: int = MISSING  # N >= 1: every N GRPO steps the reference becomes a copy of the policy; 0: never

    def validate(self) -> None:
        _check(self.reset_every >= 0, "reference.reset_every", "must be >= 0 (0: the warm start stays the reference)")


@dataclass
class PerfConfig:
    peak_tflops: Optional[float] = MISSING  # per device, for perf/mfu; null: look the device up in flops.py
    share_prompts: Optional[bool] = MISSING  # a group's common prompt once per pack; null: Config.share_prompts
    overlap_reference: Optional[bool] = MISSING  # reference logprobs beside the update; null: Config.overlap_reference
    gc_threshold: Optional[int] = MISSING  # Python's young-generation GC threshold in the trainer; null: Python's (700)

    def validate(self) -> None:
        _check(self.peak_tflops is None or self.peak_tflops > 0, "perf.peak_tflops", "must be null or > 0")
        _check(self.gc_threshold is None or self.gc_threshold >= 1, "perf.gc_threshold", "must be null or >= 1")


@dataclass
class CheckpointConfig:
    save_every: int = MISSING  # 0: only at the end
    save_every_s: float = MISSING  # also every this many seconds of GRPO; 0: not by time
    keep: int = MISSING

    def validate(self) -> None:
        _check(self.keep >= 1, "checkpoint.keep", "must be >= 1")
        _check(self.save_every >= 0, "checkpoint.save_every", "must be >= 0")
        _check(self.save_every_s >= 0, "checkpoint.save_every_s", "must be >= 0")


@dataclass
class LoggerConfig:
    """Where the step metrics go besides metrics.jsonl (nemo_orchestra.train.metric_logger)."""

    tensorboard: bool = MISSING  # event files in <run.output_dir>/tensorboard
    wandb: bool = MISSING  # Weights & Biases (pip install wandb)
    wandb_project: str = MISSING
    wandb_run_name: Optional[str] = MISSING  # null: the run folder's name
    wandb_mode: str = MISSING  # auto: online with an API key (WANDB_API_KEY or wandb login), else offline

    def validate(self) -> None:
        _check(self.wandb_mode in ("auto", "online", "offline"), "logger.wandb_mode", "must be auto, online or offline")


@dataclass
class ExportConfig:
    enabled: bool = MISSING
    dir: Optional[str] = MISSING  # null: <run.output_dir>/hf


@dataclass
class ToolsConfig:
    url: Optional[str] = MISSING  # null: start a local service; else comma-separated URLs
    token: Optional[str] = MISSING
    workers: int = MISSING
    startup_timeout_s: float = MISSING
    service: Dict[str, Any] = MISSING  # the service's config file: tools_env.service_config.ServiceConfig's keys

    def validate(self) -> None:
        self.service_config()

    def service_config(self):
        """``service`` as the service reads it (``tools_env.service_config.ServiceConfig``): every key it
        leaves out keeps the service's default; an unknown key or a wrong type names ``tools.service.KEY``."""
        from tools_env.service_config import ServiceConfig

        try:
            return ServiceConfig.from_dict(self.service)
        except ValueError as e:
            raise ConfigError(f"tools.service: {e}") from None


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)

    def validate(self) -> "Config":
        for f in fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        m, p = self.model, self.parallel
        _check(m.num_layers % p.pp == 0, "parallel.pp", f"must divide model.num_layers ({m.num_layers})")
        _check(
            m.num_query_groups % p.tp == 0 and m.ffn_hidden_size % p.tp == 0,
            "parallel.tp",
            f"must divide model.num_query_groups ({m.num_query_groups}) and model.ffn_hidden_size",
        )
        _check(
            not (self.perf.overlap_reference and (p.tp > 1 or p.pp > 1 or self.reference.offload)),
            "perf.overlap_reference",
            "needs parallel.tp=1, parallel.pp=1 and reference.offload=false (two threads would interleave "
            "the passes' collectives; an offloaded reference is swapped into the policy's own module): "
            "set it to false or null",
        )
        _check(
            not (self.perf.share_prompts and m.attention_backend == "te"),
            "perf.share_prompts",
            "needs model.attention_backend torch, triton or auto (TransformerEngine's attention takes no "
            "shared prompt): set perf.share_prompts=false or null",
        )
        _check(
            not (self.advantage.grad_variance_every and p.pp > 1),
            "advantage.grad_variance_every",
            "needs parallel.pp=1 (each group's gradient is taken outside the pipeline schedule): set it to 0",
        )
        r = self.rollout
        _check(
            r.steps_ahead == 0 or self.loss.tis_cap is not None,
            "loss.tis_cap",
            f"must be set with rollout.steps_ahead={r.steps_ahead}: rollouts of older policy versions "
            "are corrected by truncated importance sampling (e.g. loss.tis_cap=2.0)",
        )
        _check(
            r.steps_ahead == 0 or not ENGINES[r.engine].capabilities.reads_policy_weights,
            "rollout.steps_ahead",
            "needs an engine that holds its own copy of the weights "
            f"({' or '.join(n for n, e in ENGINES.items() if not e.capabilities.reads_policy_weights)}): "
            f"the {r.engine} engine generates with the weights being trained",
        )
        _check(
            r.steps_ahead == 0
            or self.parallel.tp == 1
            or not ENGINES[r.engine].capabilities.spans_tensor_parallel_group,
            "rollout.steps_ahead",
            f"needs parallel.tp=1 with rollout.engine={r.engine} (got tp={self.parallel.tp}): its forwards span the "
            "tensor-parallel group, whose other ranks would serve them while they train; use rollout.engine=vllm",
        )
        _check(
            self.warm_start.max_calls == 1 or self.warm_start.max_calls < r.max_turns,
            "warm_start.max_calls",
            f"must be below rollout.max_turns ({r.max_turns}): a scripted episode's calls and its answer "
            "must fit the turns a rollout has (1, the default, is taken with any rollout.max_turns)",
        )
        _check(
            not self.warm_start.copy_lessons or not self.data.train_path,
            "warm_start.copy_lessons",
            "copy lessons are made from the embedded default task set: set warm_start.copy_lessons=0 (or null) with "
            "data.train_path",
        )
        return self

    @property
    def share_prompts(self) -> bool:
        """Whether packs hold a group's common prompt once (``perf.share_prompts``). null: with the
        torch attention backend (``auto`` without CUDA), the path measured; not with triton, whose
        fused kernel the shared packs would trade for SDPA per sequence, nor with TransformerEngine's,
        which cannot attend across sequences."""
        share = self.perf.share_prompts
        if share is not None:
            return bool(share)
        backend = self.model.attention_backend
        if backend == "auto":
            import torch

            backend = "triton" if torch.cuda.is_available() else "torch"
        return backend == "torch"


def _read_yaml(path: Path):
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    return OmegaConf.load(path)


def _group_file(group: str, name: str, conf_dir: Path) -> Path:
    path = conf_dir / group / f"{name}.yaml"
    if not path.is_file():
        options = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        raise ConfigError(f"{group}={name}: no such {group} group file; choose one of {options}")
    return path


def _split_overrides(overrides: List[str]) -> list[tuple[str, str]]:
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        pairs.append((key.strip(), value))
    return pairs


def _defaults(tree) -> dict:
    """A file's ``defaults:`` table (its group choices, and for a recipe the recipe it is a delta on)."""
    node = tree.get("defaults")
    return dict(OmegaConf.to_container(node)) if node else {}


def recipe_chain(name: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The recipe ``name`` and the recipes it is a delta on (its ``defaults.recipe``), base-most first."""
    chain: list[str] = []
    while name is not None:
        if name in chain:
            raise ConfigError(f"recipe={name}: its recipes name each other in a loop ({' -> '.join(chain + [name])})")
        path = conf_dir / "recipes" / f"{name}.yaml"
        if not path.is_file():
            options = sorted(p.stem for p in (conf_dir / "recipes").glob("*.yaml"))
            raise ConfigError(f"recipe={name}: no such recipe file; choose one of {options}")
        chain.insert(0, name)
        name = _defaults(OmegaConf.load(path)).get("recipe")
    return chain


def choices(overrides: List[str] = (), base: str = "grpo_orchestrator", conf_dir: Path = CONF_DIR):
    """What ``compose`` reads: the recipe chain (base-most first) and the file chosen for each group. A group
    named on the command line wins over a recipe's choice, a recipe's over the one it is a delta on, and any
    recipe's over the base file's; no ``recipe=``: the base file's ``defaults.recipe``."""
    conf_dir = Path(conf_dir)
    pairs = _split_overrides(overrides)
    defaults = _defaults(_read_yaml(conf_dir / f"{base}.yaml"))
    named = [v for k, v in pairs if k == "recipe"]
    recipe = named[-1] if named else defaults.pop("recipe", None)
    defaults.pop("recipe", None)
    chain = recipe_chain(recipe, conf_dir) if recipe else []
    for name in chain:
        delta = _defaults(OmegaConf.load(conf_dir / "recipes" / f"{name}.yaml"))
        defaults.update({k: v for k, v in delta.items() if k != "recipe"})
    defaults.update({k: v for k, v in pairs if k in GROUPS})
    for group in GROUPS:
        if group not in defaults:
            where = f"recipe {chain[-1]}" if chain else f"{base}.yaml"
            raise ConfigError(f"defaults.{group}: no {group} group chosen (in {where} or as {group}=NAME)")
    return chain, {g: str(defaults[g]) for g in GROUPS}


def compose(overrides: List[str] = (), base: str = "grpo_orchestrator", conf_dir: Path = CONF_DIR):
    """Compose the raw OmegaConf tree: the base file, each group file merged into its section, the recipe
    chain's deltas (base-most first), then the ``key=value`` overrides (returned as a dotlist)."""
    conf_dir = Path(conf_dir)
    pairs = _split_overrides(overrides)
    chain, groups = choices(overrides, base, conf_dir)
    tree = _read_yaml(conf_dir / f"{base}.yaml")
    tree.pop("defaults", None)
    for group, name in groups.items():
        tree[group] = OmegaConf.merge(tree.get(group) or {}, _read_yaml(_group_file(group, name, conf_dir)))
    for name in chain:
        delta = _read_yaml(conf_dir / "recipes" / f"{name}.yaml")
        delta.pop("defaults", None)
        _refuse_removed(delta, f"conf/recipes/{name}.yaml")
        tree = OmegaConf.merge(tree, delta)
    dotlist = [f"{k}={v}" for k, v in pairs if k not in GROUPS and k != "recipe"]
    for item in dotlist:
        _refuse_removed_key(item.split("=", 1)[0], "the command line")
    _refuse_removed(tree, f"{base}.yaml or a group file")
    return tree, dotlist


# Keys of options that were measured and not kept: each is refused by name, pointing at the log that holds its
# figures and the commit to go back to.
REMOVED_LOG = "docs/results/negative_and_superseded.md"
REMOVED_KEYS = {
    "loss.lesson_schemas": "GRPO's copy lessons written with the tool schemas",
}
# Keys that have another name now (one name per concept): each old name is refused, naming the new one.
RENAMED_KEYS = {
    "sft.copy_episodes": "warm_start.copy_lessons",
    "sft.copy_batch_size": "warm_start.copy_lessons_per_step",
    "sft": "warm_start",
    "rollout.max_staleness": "rollout.steps_ahead",
    "loss.lesson_coef": "loss.copy_lesson_coef",
    "loss.lesson_batch_size": "loss.copy_lessons_per_step",
}


def _refuse_removed_key(key: str, where: str) -> None:
    if key in REMOVED_KEYS:
        raise ConfigError(
            f"{key}: removed ({REMOVED_KEYS[key]}: measured and not kept); its figures and the commit that "
            f"had it are in {REMOVED_LOG} (set in {where})"
        )
    for old, new in RENAMED_KEYS.items():
        if key == old or key.startswith(old + "."):
            raise ConfigError(f"{key}: renamed {new + key[len(old) :]} (set in {where})")


def _refuse_removed(tree, where: str) -> None:
    for key in (*REMOVED_KEYS, *RENAMED_KEYS):
        if OmegaConf.select(tree, key, default=_ABSENT) is not _ABSENT:
            _refuse_removed_key(key, where)


def load_config(overrides: List[str] = (), base: str = "grpo_orchestrator", conf_dir: Path = CONF_DIR) -> Config:
    """Build the typed config; raise ConfigError naming the key on any mistake."""
    tree, dotlist = compose(overrides, base, conf_dir)
    cfg: Config = _structured(Config, tree, dotlist, base)
    try:
        return cfg.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_structured(cls: type[T], overrides: List[str] = ()) -> T:
    """A recipe's own typed config (a dataclass with defaults) from ``key=value`` overrides: the same
    rules as ``load_config`` (dotted keys, YAML values, comma lists for list fields, an unknown key or
    a wrong type is a ConfigError naming the key); the dataclass's ``validate()`` runs when it has one."""
    dotlist = []
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"argument {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        dotlist.append(f"{key.strip()}={value}")
    cfg = _structured(cls, OmegaConf.create(), dotlist, cls.__name__)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return cfg


def load_recipe_config(cls: type[T], argv: List[str]) -> tuple[T, Config]:
    """A recipe that takes keys of its own (the dataclass ``cls``) beside the main job's: the
    arguments whose top-level key is a field of ``cls`` load it (``load_structured``), the rest the
    main config (``load_config``: ``parallel.tp=2``, ``model=...``)."""
    own = {f.name for f in fields(cls)}
    mine = [a for a in argv if a.split("=", 1)[0].split(".")[0] in own]
    return load_structured(cls, mine), load_config([a for a in argv if a not in mine])


def _structured(cls: type[T], tree, dotlist: List[str], source: str) -> T:
    schema = OmegaConf.structured(cls)
    try:
        merged = OmegaConf.merge(schema, tree)
        for item in dotlist:
            key, value = item.split("=", 1)
            node = OmegaConf.select(merged, key, default=_ABSENT)
            if node is _ABSENT:
                if not _is_open_dict_key(merged, key):
                    raise ConfigError(f"{key}: unknown config key{_valid_keys(merged, key)}")
                node = None  # a new key of a free-form mapping: its value is typed as YAML reads it
            OmegaConf.update(merged, key, _parse_value(value, node), merge=True)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"{missing[0]}: no value set (every key needs a default in {source})")
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None


_ABSENT = object()


def _is_open_dict_key(merged, key: str) -> bool:
    """A key under a free-form mapping (``Dict[str, ...]``: tools.service.*, reward.default_preference.*,
    a recipe's ``mix.*``), where new keys are allowed; a dataclass section's keys are fixed."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        node = OmegaConf.select(merged, ".".join(parts[:i]), default=None)
        if node is not None and OmegaConf.is_dict(node):
            return OmegaConf.get_type(node) is dict
    return False


def _parse_value(raw: str, node: Any) -> Any:
    """A YAML scalar; for a list field, ``a,b`` is the list [a, b]."""
    value = yaml.safe_load(raw) if raw else raw
    if OmegaConf.is_list(node) and not isinstance(value, list):
        return [yaml.safe_load(v.strip()) for v in str(raw).split(",") if v.strip()]
    if isinstance(node, str) and value is not None and not isinstance(value, str):
        return raw  # a string field keeps what was typed ("007" stays "007")
    return value


def _valid_keys(merged, key: str) -> str:
    parent = key.rpartition(".")[0]
    node = OmegaConf.select(merged, parent, default=None) if parent else merged
    if node is None or not OmegaConf.is_dict(node):
        return ""
    return f"; valid keys{' under ' + parent if parent else ''}: {', '.join(sorted(str(k) for k in node.keys()))}"


def to_dict(cfg: Config) -> Dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def save_config(cfg: Config, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), path)


def config_keys(cls=Config, prefix: str = "") -> List[str]:
    """Every leaf key of the schema, dotted (used by the test that the base file sets them all)."""
    out = []
    for f in fields(cls):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if is_dataclass(sub):
            out += config_keys(type(sub), f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out
