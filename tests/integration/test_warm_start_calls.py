"""What the warm start spends: no scripted episode calls an expert that a real endpoint serves unless
``warm_start.endpoint_experts`` asks for it, and a run with no warm start (``warm_start.steps=0`` and a tokenizer of its
own, or a resume past it) runs none of its episodes."""

from __future__ import annotations

import json
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, replace

import pytest

import nemo_orchestra.train.warm_start as warm_start_module
from nemo_orchestra.config import load_config
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.train.build import build_trainer
from tools_env.service_config import ServiceConfig

pytestmark = pytest.mark.slow

SHORT = [
    "rollout.engine=hf",
    "warm_start.steps=2",
    "warm_start.num_episodes=48",
    "warm_start.copy_lessons=16",
    "data.num_train_tasks=16",
    "data.num_eval_tasks=4",
    "evaluation.enabled=false",
    "export.enabled=false",
]


def _with_a_paid_expert(cfg, url: str):
    """expert-large served by the fake endpoint at ``url``; the other aliases simulated."""
    simulated = {a: asdict(c) for a, c in ServiceConfig.from_dict({}).experts.simulated.items() if a != "expert-large"}
    paid = {"base_url": url, "model": "echo", "price_in": 1.25, "price_out": 10.0}
    experts = {**cfg.tools.service.get("experts", {}), "simulated": simulated, "endpoints": {"expert-large": paid}}
    return replace(cfg, tools=replace(cfg.tools, service={**cfg.tools.service, "experts": experts}))


def _requests(url: str) -> int:
    with urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/stats") as r:
        return sum(json.load(r).values())


def _build(cfg, resume_from=None):
    """(scripted trajectories, copy lessons, the tokenizer's size) of a trainer built from ``cfg``."""
    info = init_distributed(cfg.parallel, cfg.run.seed)
    with ExitStack() as stack:
        trainer = build_trainer(cfg, info, stack, resume_from)
        stack.callback(trainer.close)
        return len(trainer.warm_start_trajectories), len(trainer.copy_lessons), len(trainer.tokenizer)


def test_the_warm_start_calls_a_paid_expert_only_when_asked(tmp_path, fake_openai):
    cfg = _with_a_paid_expert(load_config([*SHORT, f"run.output_dir={tmp_path / 'free'}"]), fake_openai)
    before = _requests(fake_openai)
    scripted, copies, _ = _build(cfg)
    assert scripted == 48 and copies == 16 and _requests(fake_openai) == before
    asked = load_config([*SHORT, f"run.output_dir={tmp_path / 'paid'}", "warm_start.endpoint_experts=true"])
    _build(_with_a_paid_expert(asked, fake_openai))
    assert _requests(fake_openai) > before  # the same episodes, expert-large among their choices


def test_a_run_without_a_warm_start_runs_none_of_its_episodes(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _, _, vocab = _build(load_config([*SHORT, f"run.output_dir={run}"]))  # a fresh run: tokenizer/ saved
    made = []
    episodes = warm_start_module.scripted_episodes

    async def counting(tasks, *args, **kwargs):
        made.append((len(tasks), kwargs.get("copy", False)))
        return await episodes(tasks, *args, **kwargs)

    monkeypatch.setattr(warm_start_module, "scripted_episodes", counting)
    # a resume past the warm start: the run's own tokenizer, and only GRPO's copy lessons (loss.copy_lesson_coef)
    scripted, copies, resumed_vocab = _build(load_config([*SHORT, f"run.output_dir={run}"]), "checkpoints/step_1")
    assert scripted == 0 and resumed_vocab == vocab and made == [(16, True)]
    made.clear()
    none = [*SHORT, f"run.output_dir={tmp_path / 'none'}", "warm_start.steps=0", f"model.tokenizer={run / 'tokenizer'}"]
    assert _build(load_config(none))[:2] == (0, 0) and made == []
