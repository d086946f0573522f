"""A trained orchestrator as the evaluation policy: a Hugging Face export folder, run in process.

``checkpoint:DIR`` takes a run folder (its ``hf/`` export) or an export folder itself. It is the
``hf`` generation engine on the exported weights, driven by the same ``EnginePolicy`` as training's
rollouts: the prompt is the chat template's rendering of the episode's messages and tools, the
policy's own turns stay as it generated them. Generation is greedy by default; sampled turns
draw from their own seeds (``loop.turn_seed``), as in training. A run folder's
``config.yaml`` supplies the settings its held-out report used (``run_settings``): turn and
context limits, tokens per turn, the orchestrator's token prices, the default preference and the tool
service's config (a local service evaluate.py starts runs with it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from nemo_orchestra.prompting.chat import ChatFormat
from nemo_orchestra.rollout.engines.hf import HFEngine
from nemo_orchestra.rollout.loop import EnginePolicy, LoopLimits


def resolve_export(path: str) -> str:
    for folder in (path, os.path.join(path, "hf")):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise FileNotFoundError(f"checkpoint:{path}: no Hugging Face export (config.json) in {path} or {path}/hf")


@dataclass
class RunSettings:
    limits: LoopLimits
    max_new_tokens: int
    default_preference: dict[str, float]
    enable_thinking: bool | None = None  # the template variable the run rendered with (model.enable_thinking)
    reasoning_parser: bool = False  # the run's turns were read as a reasoning parser reads them
    service: dict | None = None  # the run's tool service config (``tools.service``: its tools' prices and settings)


def run_settings(path: str) -> RunSettings | None:
    """The rollout settings of the run whose folder (or ``hf/`` export) is ``path``; None without its
    ``config.yaml``."""
    for folder in (path, os.path.dirname(os.path.normpath(path))):
        file = os.path.join(folder, "config.yaml")
        if os.path.isfile(os.path.join(folder, "hf", "config.json")) and os.path.isfile(file):
            import yaml

            with open(file) as f:
                cfg = yaml.safe_load(f) or {}
            try:
                r = cfg["rollout"]
                limits = LoopLimits(
                    max_turns=r["max_turns"],
                    task_turns=r.get("task_turns", True),  # a run from before the setting: the loop's default
                    max_context=r["max_context"],
                    turn_tokens=r["max_new_tokens_per_turn"],
                    batch_window_s=r["batch_window_s"],
                    price_in=r["orchestrator_price_in"],
                    price_out=r["orchestrator_price_out"],
                )
                return RunSettings(
                    limits,
                    r["max_new_tokens_per_turn"],
                    dict(cfg["reward"]["default_preference"]),
                    (cfg.get("model") or {}).get("enable_thinking"),
                    bool((cfg.get("model") or {}).get("reasoning_parser", False)),
                    (cfg.get("tools") or {}).get("service"),
                )
            except (KeyError, TypeError) as e:
                raise ValueError(
                    f"checkpoint:{path}: {file} lacks the run setting {e} "
                    "(not a config.yaml written by recipes/grpo_orchestrator.py)"
                ) from None
    return None


def checkpoint_policy(
    path: str,
    temperature: float = 0.0,
    max_new_tokens: int = 96,
    top_p: float = 1.0,
    seed: int = 0,
    enable_thinking: bool | None = None,
) -> EnginePolicy:
    """``seed``: mixed into each sampled turn's seed (``loop.turn_seed``); 0 draws as a run's own
    held-out evaluation does. The chat template is the export's (the one the run trained with);
    ``enable_thinking``: its variable, the run's when ``path`` is a run folder and this is None."""
    from transformers import AutoTokenizer

    folder = resolve_export(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    engine = HFEngine.from_export(folder, tokenizer)
    name = f"checkpoint:{os.path.basename(os.path.normpath(path))}"
    salt = str(seed) if seed else ""
    settings = run_settings(path)
    if enable_thinking is None and settings is not None:
        enable_thinking = settings.enable_thinking
    chat = ChatFormat(tokenizer, None, enable_thinking, settings.reasoning_parser if settings is not None else False)

    return EnginePolicy(engine, chat, max_new_tokens, temperature, top_p, name=name, seed=salt)
