"""Benchmarks, one subcommand each.

    python recipes/benchmark.py tools_env [--out FILE] [--workers N] [--seconds S]
    python recipes/benchmark.py chat [--entries N] [--out FILE]
    python recipes/benchmark.py grpo [--steps N] [--warmup N|auto] [--out FILE] [key=value ...]
    python recipes/benchmark.py generate [--engines hf,megatron] [--prompts N] [--out FILE] [key=value ...]
    python recipes/benchmark.py NAME --help                 # its flags with their defaults (grpo: and keys)

Subcommands live in ``BENCHMARKS`` (name -> (module path, one-line description)); each module
provides ``add_args(parser)`` (optional) and ``main(args) -> int``, and is imported only when
its subcommand runs, so one benchmark's dependencies never break another.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BENCHMARKS: dict[str, tuple[str, str]] = {
    "tools_env": ("benchmarks.tools_env", "tool service: calls/s and p50/p99 at 1/64/512 episodes"),
    "chat": (
        "benchmarks.chat_templates",
        "trained = served: the template probe, rendering per turn, tokens per episode against per-turn samples",
    ),
    "grpo": (
        "benchmarks.grpo",
        "GRPO step: tokens/s and time per phase (generation, environment, logprobs, training, weight sync)",
    ),
    "generate": (
        "benchmarks.generate",
        "in-process engines: generated tokens/s on the same prompts, prefill and decode, against the device's bound",
    ),
}

TAKES_MAIN_CONFIG = ("grpo", "generate")  # its key=value arguments are the main job's config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    valid = ", ".join(sorted(BENCHMARKS))
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nbenchmarks:\n" + "\n".join(f"  {k:<12} {v[1]}" for k, v in sorted(BENCHMARKS.items())))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"error: unknown benchmark '{name}'; valid: {valid}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[name][0])
    parser = argparse.ArgumentParser(
        prog=f"benchmark.py {name}", description=BENCHMARKS[name][1], formatter_class=HelpFormatter
    )
    if hasattr(module, "add_args"):
        module.add_args(parser)
    if name in TAKES_MAIN_CONFIG and any(a in ("-h", "--help") for a in rest):
        from nemo_orchestra.config_help import main_keys_help

        parser.epilog = main_keys_help([a for a in rest if "=" in a])
    # key=value overrides may come before or after the flags
    return module.main(parser.parse_intermixed_args(rest))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Flags with their defaults (those that have one); the epilog (the main job's keys) as it is written."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, argparse.SUPPRESS) else super()._get_help_string(action)


if __name__ == "__main__":
    from nemo_orchestra.runtime.reaper import contain

    contain()  # the tool service, vLLM's processes: every process a benchmark starts ends with it
    sys.exit(main())
