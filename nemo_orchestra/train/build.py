"""Assembly of a run from its config: tasks, tool service, warm-start data, tokenizer, learner, engine,
rollout source, trainer."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from contextlib import ExitStack
from dataclasses import replace

import torch

from nemo_orchestra.config import Config, save_config, to_dict
from nemo_orchestra.data.default_tasks import generate_tasks, plan_phrases
from nemo_orchestra.data.warm_start import render_text, to_trajectory
from nemo_orchestra.grpo.reward import assign_rewards
from nemo_orchestra.megatron.model import padded_vocab_size
from nemo_orchestra.megatron.parallel import DistInfo, once_per_node
from nemo_orchestra.prompting.chat import QWEN3_CHAT_TEMPLATE, resolve_chat_format
from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer, load_tokenizer
from nemo_orchestra.rollout.engines import EngineContext, capabilities, check_engine, start_engine
from nemo_orchestra.rollout.managed_engine import ManagedEngine
from nemo_orchestra.train.flops import slow_half_precision_warning
from nemo_orchestra.train.memory_plan import memory_check
from nemo_orchestra.train.metric_logger import MetricLogger
from nemo_orchestra.train.data_order import DataOrder
from nemo_orchestra.train.learner import build_learner
from nemo_orchestra.train.rollout_source import Episodes, RolloutSource
from nemo_orchestra.train.run_plan import RunPlan
from nemo_orchestra.train.trainer import Trainer, close_loop
from nemo_orchestra.train.warm_start import corpus_seed, play_warm_start_episodes
from tools_env.task import load_jsonl

log = logging.getLogger(__name__)


def load_tasks(cfg: Config):
    if cfg.data.train_path:
        if not os.path.isfile(cfg.data.train_path):
            raise FileNotFoundError(
                f"data.train_path: no task file at {cfg.data.train_path} (docs/data_and_evaluation.md; "
                "recipes/synthesize_data.py writes one)"
            )
        return load_jsonl(cfg.data.train_path)
    return generate_tasks(cfg.data.num_train_tasks, cfg.run.seed, cfg.data.categories, corpus_seed(cfg))


def load_eval_tasks(cfg: Config):
    if cfg.data.eval_path:
        return load_jsonl(cfg.data.eval_path)
    # disjoint seeds: train, warm start, eval
    return generate_tasks(cfg.data.num_eval_tasks, cfg.run.seed + 2, cfg.data.categories, corpus_seed(cfg))


def tool_service(cfg: Config, stack: ExitStack, started: list | None = None) -> list[str]:
    """URLs of the tool service: the configured replicas, or one started here for this node (its
    handle appended to ``started``)."""
    if cfg.tools.url:
        urls = [u.strip().rstrip("/") for u in cfg.tools.url.split(",") if u.strip()]
        for url in urls:
            _check_health(url, cfg.tools.startup_timeout_s)
        return urls
    from tools_env.supervisor import start_service

    def start() -> list[str]:
        handle = stack.enter_context(
            start_service(
                dict(cfg.tools.service),
                workers=cfg.tools.workers,
                token=cfg.tools.token,
                timeout_s=cfg.tools.startup_timeout_s,
            )
        )
        log.info("tool service started at %s", ", ".join(handle.urls))
        if started is not None:
            started.append(handle)
        return list(handle.urls)

    # one replica per node, started by its local rank 0 and shared with the node's other ranks
    return once_per_node(start, os.path.join(cfg.run.output_dir, "tools_urls"))


def restartable(started: list):
    """The service this process started, when no other process uses it (then it may be restarted
    in place: tools_env.recovery); None for a service given by URL or shared by a node's ranks."""
    import torch.distributed as dist

    shared = dist.is_initialized() and dist.get_world_size() > 1
    return started[0] if started and not shared else None


def _check_health(url: str, timeout_s: float) -> None:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=min(timeout_s, 10.0)) as r:
            r.read()
    except Exception as e:
        raise ValueError(f"tools.url: no tool service answers at {url}/healthz ({e})") from None


def gc_threshold(threshold: int | None, stack: ExitStack) -> None:
    """Python's young-generation collection threshold for the run (``perf.gc_threshold``), Python's
    own again when ``stack`` closes; None leaves it. The threshold must be high enough that the
    rollouts' short-lived objects (vLLM's outputs decoded at every decode step, the turns' token
    lists) die before a young collection meets them: promoted, they set off full collections of the
    process's heap, which stop every thread of the trainer (docs/performance.md)."""
    if threshold is None:
        return
    previous = gc.get_threshold()
    gc.set_threshold(threshold, *previous[1:])
    stack.callback(gc.set_threshold, *previous)


def build_trainer(cfg: Config, info: DistInfo, stack: ExitStack, resume_from: str | None = None) -> Trainer:
    """The trainer, its tool service (closed by ``stack``), warm-start data, tokenizer, policy and engine.
    ``resume_from``: the checkpoint the run will resume from (``run_control.check_resume``), whose run
    folder holds the tokenizer it was trained with; the warm start's episodes are then not run.
    A failure on the way closes the tool-service client and its event loop before it propagates."""
    from tools_env.client import ToolsEnvClient

    check_engine(cfg.rollout.engine)  # a missing vLLM stops the run now, not after the warm start
    gc_threshold(cfg.perf.gc_threshold, stack)
    os.makedirs(cfg.run.output_dir, exist_ok=True)
    tasks = load_tasks(cfg)
    started: list = []
    urls = tool_service(cfg, stack, started)
    loop = asyncio.new_event_loop()
    client = ToolsEnvClient(
        urls, token=cfg.tools.token or os.environ.get("TOOLS_ENV_TOKEN"), service=restartable(started)
    )
    try:
        trainer = _build(cfg, info, tasks, client, loop, resume_from)
    except BaseException:
        close_loop(loop, client)
        raise
    if info.is_main:  # the run's config, once everything it asks for is built: a refused run leaves the old one
        save_config(cfg, os.path.join(cfg.run.output_dir, "config.yaml"))
    return trainer


def _build(
    cfg: Config, info: DistInfo, tasks: list, client, loop: asyncio.AbstractEventLoop, resume_from: str | None
) -> Trainer:
    # a user's tokenizer and its chat template are checked before any episode runs
    tokenizer = load_tokenizer(cfg.model.tokenizer) if cfg.model.tokenizer else None
    run_tokenizer = os.path.join(cfg.run.output_dir, "tokenizer")
    if tokenizer is None and resume_from and os.path.isdir(run_tokenizer):
        tokenizer = load_tokenizer(run_tokenizer)  # the ids the checkpoint was trained with
    chat = resolve_chat_format(tokenizer, *chat_options(cfg)) if tokenizer else None
    plan = RunPlan.make(cfg, info.device, resume_from)
    # the embedded tokenizer is built from the scripted episodes' text
    scripted, copies = play_warm_start_episodes(cfg, plan, tasks, client, loop, corpus=tokenizer is None)
    if tokenizer is None:
        corpus = [render_text(ep, QWEN3_CHAT_TEMPLATE, cfg.reward) for ep in scripted]
        tokenizer = build_embedded_tokenizer(corpus, phrases=plan_phrases(cfg.data.categories))
        chat = resolve_chat_format(tokenizer, *chat_options(cfg))
    tokenizer.chat_template = chat.template  # the template trained with is the one the export ships
    if info.is_main:
        tokenizer.save_pretrained(os.path.join(cfg.run.output_dir, "tokenizer"))
    vocab = cfg.model.vocab_size or padded_vocab_size(len(tokenizer), cfg.parallel.tp)
    kv_cache_bytes = memory_check(cfg, vocab, info.dp * info.tp * info.pp, info.device)  # before any GPU memory

    slow = slow_half_precision_warning(cfg.model.params_dtype, info.device)
    if slow and info.is_main:
        log.warning(slow)
    learner = build_learner(cfg, vocab, info.device)
    ctx = EngineContext(
        cfg.model,
        vocab,
        tokenizer,
        info.device,
        rollout=cfg.rollout,
        seed=cfg.run.seed,
        model=learner.module,
        parallel=cfg.parallel,
        kv_cache_bytes=kv_cache_bytes,
        live_sequences=plan.live_sequences,
    )
    generation = managed_engine(cfg, info, plan, ctx)
    logger = MetricLogger(cfg.run.output_dir, enabled=info.is_main, cfg=cfg.logger, run_config=to_dict(cfg))
    order = DataOrder(tasks, cfg.data.prompts_per_step, cfg.run.seed, info.dp, info.rank // (info.tp * info.pp))
    return Trainer(
        cfg,
        plan,
        learner,
        generation,
        rollout_source(cfg, plan, generation, chat, client, loop, order),
        logger,
        tokenizer=tokenizer,
        vocab_size=vocab,
        warm_start_trajectories=[to_trajectory(ep, chat, cfg.reward) for ep in scripted],
        copy_lessons=[to_trajectory(ep, chat, cfg.reward) for ep in copies],
        rank=info.rank,
    )


def managed_engine(cfg: Config, info: DistInfo, plan: RunPlan, ctx: EngineContext) -> ManagedEngine:
    """The run's generation engine, started at its first weight sync (``ManagedEngine``) on the cores the
    plan gives it."""

    def engine_factory(state):  # when the engine starts: ManagedEngine
        if plan.engine_cpus:
            torch.set_num_threads(plan.trainer_threads)
            if info.is_main:
                log.info(
                    "rollouts ahead of training on CPU: the engine's worker on cores %s, the trainer on %d thread(s)",
                    ",".join(map(str, plan.engine_cpus)),
                    plan.trainer_threads,
                )
        cpus = list(plan.engine_cpus) if plan.engine_cpus else None
        return start_engine(cfg.rollout.engine, replace(ctx, cpus=cpus), state)

    return ManagedEngine(engine_factory, reads_policy_weights=capabilities(cfg.rollout.engine).reads_policy_weights)


def rollout_source(
    cfg: Config, plan: RunPlan, generation: ManagedEngine, chat, client, loop: asyncio.AbstractEventLoop, order
) -> RolloutSource:
    """The run's rollouts: its engine through the agent loop, on the prompts of ``order``, each group
    rewarded by ``assign_rewards`` as it comes back; ahead of training by ``plan.rollouts_ahead`` steps."""
    assert plan.rollouts_ahead == 0 or not generation.reads_policy_weights, (
        "rollout.steps_ahead > 0 needs an engine with its own weights (checked by the config)"
    )
    episodes = Episodes(cfg.rollout, cfg.reward.default_preference, generation, chat, client, loop, cfg.run.output_dir)
    return RolloutSource(
        episodes,
        order,
        lambda trajs: assign_rewards(trajs, cfg.reward),
        cfg.advantage.min_group_std,
        cfg.run.seed,
        plan.rollouts_ahead,
        cfg.trainer.max_steps,
        background=plan.rollouts_ahead > 0,
    )


def chat_options(cfg: Config) -> tuple:
    """``resolve_chat_format``'s arguments after the tokenizer: the model's chat settings."""
    return cfg.model.chat_template, cfg.model.enable_thinking, cfg.model.reasoning_parser
