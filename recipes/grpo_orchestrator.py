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
"""

import logging
import os
import signal
import sys
from contextlib import ExitStack

from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.config_help import recipe_help, wants_help
from nemo_orchestra.train.console import setup_logging


def _terminate(signum, frame):
    logging.getLogger("grpo_orchestrator").warning("stopping on signal %d", signum)
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    # SIGTERM (kill, SLURM's time limit) unwinds like an error: the generation engine's processes
    # and the tool service are shut down, not left running
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if wants_help(argv):
            print(recipe_help(__doc__, main=True, argv=argv), end="")
            return 0
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.run.log_level, int(os.environ.get("RANK", 0)))  # before Megatron and vLLM are imported

    from nemo_orchestra.hf.export import export_hf
    from nemo_orchestra.hf.qwen3 import full_state_dict
    from nemo_orchestra.megatron.parallel import destroy_distributed, init_distributed
    from nemo_orchestra.train.build import build_trainer, load_eval_tasks
    from nemo_orchestra.train.report import plot_curves, write_report

    log = logging.getLogger("grpo_orchestrator")
    info = init_distributed(cfg.parallel, cfg.run.seed)
    ckpt_root = os.path.join(cfg.run.output_dir, "checkpoints")
    with ExitStack() as stack:
        try:
            trainer = build_trainer(cfg, info, stack)
        except (ValueError, FileNotFoundError, ImportError) as e:
            log.error("%s", e)
            return 2
        stack.callback(trainer.close)
        if not trainer.resume(ckpt_root):
            trainer.warm_start()
        evals, eval_tasks = {}, load_eval_tasks(cfg) if cfg.evaluation.enabled else []
        if eval_tasks and info.is_main:  # for recomputing the held-out figures: recipes/evaluate.py tasks=...
            with open(os.path.join(cfg.run.output_dir, "heldout.jsonl"), "w") as f:
                f.writelines(t.to_json() + "\n" for t in eval_tasks)
        if eval_tasks:
            evals[f"step {trainer.step}"] = trainer.evaluate_heldout(eval_tasks)
        trainer.fit(ckpt_root)
        if eval_tasks:
            evals[f"step {trainer.step}"] = trainer.evaluate_heldout(eval_tasks)
            if info.is_main:
                plot_curves(cfg.run.output_dir)
                log.info("report: %s", write_report(cfg.run.output_dir, evals, "nemo-orchestra GRPO run"))
        if cfg.export.enabled:
            weights = full_state_dict(trainer.policy.module)  # gathered from the TP/PP shards: every rank joins
            if info.is_main:
                out = cfg.export.dir or os.path.join(cfg.run.output_dir, "hf")
                export_hf(weights, cfg.model, trainer.vocab_size, trainer.tokenizer, out)
                log.info("exported Hugging Face checkpoint to %s", out)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
