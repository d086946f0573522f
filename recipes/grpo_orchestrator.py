"""Train a tool-orchestrating LLM with GRPO (the ToolOrchestra method) on Megatron-Core.

With no arguments it trains the embedded default — a tiny Qwen3-architecture orchestrator on
a locally generated task set — against a tool service it starts itself, on a laptop CPU in a
few minutes: a short SFT warm start on the tool-call format, then GRPO with the composite
reward. The run folder gets metrics.jsonl, config.yaml, the tokenizer, a checkpoint and a
Hugging Face export.

Simplifications of the default: a tiny model, three task categories and simulated experts.

Launch:
    python recipes/grpo_orchestrator.py                                  # embedded default, CPU
    python recipes/grpo_orchestrator.py trainer.max_steps=2 run.output_dir=runs/try
    torchrun --nproc-per-node 8 recipes/grpo_orchestrator.py recipe=qwen3_8b_1n8g
Overrides are key=value (see conf/grpo_orchestrator.yaml); group=name picks conf/<group>/name.yaml;
--help lists every key with its default (after any overrides given with it).

When it stops (docs/checkpoints_and_export.md, "When a run stops"): SIGTERM, SIGINT or run.preempt_signal end the step in
flight, checkpoint and exit with one line naming the resume command (the same command: a run
resumes from its folder's newest intact checkpoint); every process it started ends with it
(runtime/reaper.py); one run per run.output_dir (run.lock). Exit codes: 0 done, 2 bad input or the
folder in use, 75 stopped by the preempt signal and asking to be requeued, 128+N stopped by signal N.
"""

import logging
import os
import sys
from contextlib import ExitStack

from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.config_help import recipe_help, wants_help
from nemo_orchestra.runtime import run_control as rc
from nemo_orchestra.runtime.console import setup_logging

log = logging.getLogger("grpo_orchestrator")


def main(argv: list[str]) -> int:
    try:
        if wants_help(argv):
            print(recipe_help(__doc__, main=True, argv=argv), end="")
            return 0
        cfg = load_config(argv)
        n_train = rc.check_task_files(cfg)  # a bad task file stops the run now, not after the warm start
        stop = rc.StopSignals(rc.preempt_signal(cfg.run.preempt_signal)).install()
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.run.log_level, int(os.environ.get("RANK", 0)))  # before Megatron and vLLM are imported
    # the folder lock; one line at the end
    code = rc.guarded(lambda: train(cfg, stop, n_train), cfg.run.output_dir, stop, cfg.run.max_restarts)
    stop.ended(code)
    return code


def train(cfg, stop: rc.StopSignals, n_train: int | None = None) -> int:
    """The run; ``n_train``: the records ``data.train_path`` holds (``check_task_files``)."""
    from nemo_orchestra.megatron.parallel import destroy_distributed, init_distributed
    from nemo_orchestra.runtime.watchdog import start_watchdog
    from nemo_orchestra.train.build import build_trainer, load_eval_tasks

    info = init_distributed(cfg.parallel, cfg.run.seed)
    rc.check_enough_tasks(cfg, n_train, info.dp)
    ckpt_root = os.path.join(cfg.run.output_dir, "checkpoints")
    if not cfg.run.resume and info.is_main:
        rc.start_afresh(cfg.run.output_dir, ckpt_root)
    built: list = []  # the trainer, once built: the watchdog writes its step with each beat
    watchdog = start_watchdog(
        cfg.run.output_dir, info.rank, info.world_size, cfg.run.stall_timeout_s, lambda: built[0].step if built else 0
    )
    with ExitStack() as stack:
        if watchdog is not None:
            stack.callback(watchdog.stop)
        try:
            resume_from = rc.check_resume(cfg, ckpt_root)  # before the run writes anything (config.yaml included)
            trainer = build_trainer(cfg, info, stack, resume_from)
        except (ValueError, FileNotFoundError, ImportError) as e:
            log.error("%s", e)
            return 2
        built.append(trainer)
        stack.callback(trainer.close)
        if not (cfg.run.resume and trainer.resume(ckpt_root)):
            trainer.warm_start()
        if info.is_main:
            rc.report_cut(cfg.run.output_dir, trainer.step)
        eval_tasks = load_eval_tasks(cfg) if cfg.evaluation.enabled else []
        evals = heldout(cfg, trainer, eval_tasks) if eval_tasks else {}
        stop.in_loop = True
        try:
            trainer.fit(ckpt_root, stop.requested)
        except rc.StopNow as e:  # a second signal dropped the step in flight
            log.warning("%s", rc.stop_line(e.signum, trainer.step, ckpt_root, in_flight=True))
            return 128 + e.signum
        stop.in_loop = False
        if stop.signum is not None:
            return rc.stopped(stop, trainer.step, ckpt_root, cfg.run.max_restarts)
        finish(cfg, info, trainer, evals, eval_tasks)
    destroy_distributed()
    return 0


def heldout(cfg, trainer, tasks: list) -> dict:
    """The held-out figures at this step: one rollout per task at ``evaluation.temperature`` (0:
    greedy), and ``evaluation.samples`` per task as GRPO samples them (``rollout.temperature``, ``top_p``)."""
    out = {f"step {trainer.step}": trainer.evaluate_heldout(tasks)}
    if k := cfg.evaluation.samples:
        out[f"step {trainer.step}, {k} samples"] = trainer.evaluate_heldout(tasks, k, cfg.rollout.temperature)
    return out


def finish(cfg, info, trainer, evals: dict, eval_tasks: list) -> None:
    """The final held-out evaluation, report and Hugging Face export."""
    from nemo_orchestra.export.hf_folder import export_hf
    from nemo_orchestra.export.qwen3 import full_state_dict
    from nemo_orchestra.train.run_report import plot_curves, write_report

    if eval_tasks:
        if info.is_main:  # for recomputing the held-out figures: recipes/evaluate.py tasks=...
            with open(os.path.join(cfg.run.output_dir, "heldout.jsonl"), "w") as f:
                f.writelines(t.to_json() + "\n" for t in eval_tasks)
        evals.update(heldout(cfg, trainer, eval_tasks))
        if info.is_main:
            plot_curves(cfg.run.output_dir)
            r, k = cfg.rollout, cfg.evaluation.samples
            sampled = f"checkpoint.temperature={r.temperature:g} checkpoint.top_p={r.top_p:g} samples={k}" if k else ""
            log.info("report: %s", write_report(cfg.run.output_dir, evals, "nemo-orchestra GRPO run", sampled))
    if cfg.export.enabled:
        weights = full_state_dict(trainer.learner.module)  # gathered from the TP/PP shards: every rank joins
        if info.is_main:
            out = cfg.export.dir or os.path.join(cfg.run.output_dir, "hf")
            sampling = (cfg.rollout.temperature, cfg.rollout.top_p)  # the server's default: as trained
            export_hf(weights, cfg.model, trainer.vocab_size, trainer.tokenizer, out, sampling=sampling)
            log.info("exported Hugging Face checkpoint to %s", out)


if __name__ == "__main__":
    from nemo_orchestra.runtime.reaper import contain

    contain()  # every process this run starts ends with it, SIGKILL included
    sys.exit(main(sys.argv[1:]))
