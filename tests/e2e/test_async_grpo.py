"""Asynchronous GRPO end to end, in process, with the hf engine (its own copy of the weights):

- the rollouts-ahead machinery at K = 0 trains exactly as the synchronous loop (bitwise weights);
- at K = 1 rollouts overlap training (some turns one version behind), never more than K behind, here
  with per-turn credit and the policy-gradient variance of both credits measured every other step;
- a run stopped at a checkpoint and resumed keeps the data order of an uninterrupted run;
- dynamic sampling draws extra prompts when groups carry no signal, within its cap;
- a reference reset makes the KL reference the policy of its step, and a resumed run keeps it;
- the megatron engine on a copy of its own trains as on the live weights, and runs ahead.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.megatron.sharding import model_state
from nemo_orchestra.train.build import build_trainer

pytestmark = pytest.mark.slow

SHORT = [
    "rollout.engine=hf",
    "warm_start.steps=4",
    "warm_start.num_episodes=16",
    "data.num_train_tasks=32",
    "data.num_eval_tasks=4",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_turns=3",
    "rollout.max_new_tokens_per_turn=48",
    "evaluation.enabled=false",
    "export.enabled=false",
    "loss.tis_cap=2.0",
    "advantage.min_group_std=-1.0",
    "advantage.drop_format_errors=false",  # the barely warm-started policy's malformed rollouts are trained on too
]


def run(tmp_path, name: str, overrides: list[str], steps: int, k0_async: bool = False, reference: dict | None = None):
    """A short run in process; (final weights, metrics per step, trajectories' turn versions per step).
    ``reference``: filled with the KL reference's final weights."""
    out = os.path.join(tmp_path, name)
    cfg = load_config([*SHORT, f"run.output_dir={out}", f"trainer.max_steps={steps}", *overrides])
    info = init_distributed(cfg.parallel, cfg.run.seed)
    versions: dict[int, list[list[int]]] = {}
    with ExitStack() as stack:
        trainer = build_trainer(cfg, info, stack)
        stack.callback(trainer.close)
        ckpt = os.path.join(out, "checkpoints")
        if not trainer.resume(ckpt):
            trainer.warm_start()
        produce = trainer.rollouts.produce

        async def recording(step):
            trajs, stats = await produce(step)
            versions[step] = [[r.version for r in t.turns] for t in trajs]
            return trajs, stats

        trainer.rollouts.produce = recording
        if k0_async:
            trainer.rollouts.background = True  # the rollouts-ahead thread, at K = 0
        trainer.fit(ckpt)
        weights = {k: v.clone() for k, v in model_state(trainer.learner.module).items()}
        if reference is not None:
            reference.update({k: v.clone() for k, v in model_state(trainer.learner.reference).items()})
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    return weights, metrics, versions


# a format-only warm start (no copy lessons, the faster rate): enough for some rollouts to earn a reward
WARM = ["warm_start.steps=40", "warm_start.num_episodes=64", "warm_start.lr=3e-3", "warm_start.copy_lessons=0"]


def test_k0_through_the_async_machinery_equals_the_synchronous_loop(tmp_path):
    warm = WARM
    sync_w, sync_m, _ = run(tmp_path, "sync", warm, steps=3)
    async_w, async_m, versions = run(tmp_path, "k0", warm, steps=3, k0_async=True)
    assert [m["data/task_ids"] for m in sync_m] == [m["data/task_ids"] for m in async_m]
    assert [m["reward/mean"] for m in sync_m] == [m["reward/mean"] for m in async_m]
    assert all(torch.equal(sync_w[k], async_w[k]) for k in sync_w)
    assert any(m["reward/mean"] > 0 for m in sync_m)  # some rollouts earned a reward: GRPO moved the weights
    assert all(v == [s] * len(v) for s, trajs in versions.items() for v in trajs)  # every turn by this step's policy


def test_k1_overlaps_but_never_lags_more_than_one_version(tmp_path):
    turn = [*WARM, "advantage.credit=turn", "advantage.grad_variance_every=2"]  # rewarded rollouts: a gradient
    _, metrics, versions = run(tmp_path, "k1", ["rollout.steps_ahead=1", *turn], steps=4)
    lags = [s - min(v) for s, trajs in versions.items() for v in trajs if v]
    assert max(lags) == 1, lags  # the next step's rollouts ran while this one trained
    assert min(lags) == 0 and all(0 <= lag <= 1 for lag in lags)
    assert all(v == sorted(v) for trajs in versions.values() for v in trajs)  # versions only move forward
    assert all(m["rollout/stale_dropped"] == 0 and m["rollout/staleness_max"] <= 1 for m in metrics)
    assert all(0 <= m["perf/rollout_wait_share"] <= 1 for m in metrics)
    assert all(m["advantage/turn_credited_share"] == 1.0 for m in metrics)
    measured = [m for m in metrics if "grad/pg_variance_turn" in m]
    assert [m["step"] for m in measured] == [1, 3]  # steps 0 and 2 of the loop, logged as 1 and 3
    values = [m[f"grad/pg_{k}_{c}"] for m in measured for k in ("variance", "sq_norm") for c in ("episode", "turn")]
    assert all(v is not None and v >= 0 for v in values) and max(values) > 0


def test_the_megatron_engine_on_its_own_copy_trains_as_on_the_live_weights(tmp_path):
    """rollout.engine=megatron_copy synchronously: its weights are the policy's at every sync, so the run
    is the megatron engine's, to the bit."""
    base = [*WARM, "rollout.engine=megatron"]
    live_w, live_m, _ = run(tmp_path, "live", base, steps=2)
    copy_w, copy_m, _ = run(tmp_path, "copy", [*base, "rollout.engine=megatron_copy"], steps=2)
    assert [m["reward/mean"] for m in live_m] == [m["reward/mean"] for m in copy_m]
    assert any(m["reward/mean"] > 0 for m in live_m)
    assert all(torch.equal(live_w[k], copy_w[k]) for k in live_w)


def test_the_megatron_copy_engine_runs_ahead(tmp_path):
    _, metrics, versions = run(
        tmp_path, "k1", [*WARM, "rollout.engine=megatron_copy", "rollout.steps_ahead=1"], steps=3
    )
    lags = [s - min(v) for s, trajs in versions.items() for v in trajs if v]
    assert max(lags) == 1 and min(lags) == 0, lags  # the next step's rollouts ran while this one trained
    assert all(m["rollout/staleness_max"] <= 1 for m in metrics)


def test_resume_mid_async_run_keeps_the_data_order(tmp_path):
    _, full, _ = run(tmp_path, "full", ["rollout.steps_ahead=1"], steps=4)
    overrides = ["rollout.steps_ahead=1", "checkpoint.save_every=1"]
    run(tmp_path, "resumed", overrides, steps=2)  # stops after step 2 with step 3's rollouts in flight
    _, resumed, _ = run(tmp_path, "resumed", overrides, steps=4)
    order = {m["step"]: m["data/task_ids"] for m in resumed}
    assert [order[s] for s in (1, 2, 3, 4)] == [m["data/task_ids"] for m in full]


def test_fill_informative_groups_draws_extra_prompts_within_its_cap(tmp_path, monkeypatch):
    """... and every trajectory's reward is computed once."""
    import nemo_orchestra.train.build as build_module

    rewarded: list = []  # every trajectory each call rewards (kept alive: no id is reused)
    assign = build_module.assign_rewards

    def counting(trajs, cfg):
        rewarded.extend(trajs)
        assign(trajs, cfg)

    monkeypatch.setattr(build_module, "assign_rewards", counting)
    # min_group_std high: no group is informative, so every step draws its cap of extra prompts
    _, metrics, _ = run(
        tmp_path,
        "fill",
        [
            "rollout.fill_informative_groups=true",
            "rollout.max_extra_prompts=3",
            "advantage.min_group_std=10.0",
            "advantage.credit=turn",
        ],
        steps=2,
    )
    assert [m["rollout/prompts_drawn"] for m in metrics] == [5, 5]
    assert len(rewarded) == len({id(t) for t in rewarded}) == 2 * 5 * 2  # steps x prompts x group, each once
    _, plain, _ = run(tmp_path, "plain", ["advantage.min_group_std=10.0"], steps=1)
    assert plain[0]["rollout/prompts_drawn"] == 2


def test_reference_reset_every_n_steps_and_across_a_resume(tmp_path):
    # the three one-call categories: their first two steps have rewarded rollouts to move the policy off the reference
    resets = [
        *WARM,
        "reference.reset_every=3",
        "checkpoint.save_every=1",
        "data.categories=arithmetic,lookup,reasoning",
    ]
    ref: dict = {}
    full_w, full, _ = run(tmp_path, "full", resets, steps=4, reference=ref)
    assert [m["train/reference_reset"] for m in full] == [0.0, 0.0, 1.0, 0.0]
    assert full[2]["loss/kl"] > 0 and full[3]["loss/kl"] == 0.0  # step 4 starts from its own reference
    assert any(not torch.equal(ref[k], full_w[k]) for k in ref)  # and moves the policy off it
    three_w, _, _ = run(tmp_path, "resumed", resets, steps=3)  # the policy after step 3: the reference of step 4
    assert all(torch.equal(ref[k], three_w[k]) for k in ref)
    resumed_ref: dict = {}
    _, resumed, _ = run(tmp_path, "resumed", resets, steps=4, reference=resumed_ref)
    assert all(torch.equal(resumed_ref[k], ref[k]) for k in ref)  # the checkpoint held the reset reference
    assert resumed[-1]["step"] == 4 and resumed[-1]["loss/kl"] == 0.0
