"""Copy lessons teach the warm start to copy: after a shortened warm start with them, the policy
(greedy, in the real episode format with the tool schemas) writes calculator results it never saw
into its answer. Measured: 8 of 32 exactly (short ones; longer ones lose digits), where the default
warm start without lessons copies 1 of 116."""

from __future__ import annotations

import re
from contextlib import ExitStack

import pytest

from nemo_orchestra.config import load_config
from nemo_orchestra.data.default_tasks import copy_tasks
from nemo_orchestra.data.warm_start import scripted_episodes, to_trajectory
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.prompting.chat import format_tool_call
from nemo_orchestra.train.build import build_trainer

pytestmark = pytest.mark.slow


def _answer_prefix(chat, traj, ep) -> tuple[list[int], str]:
    """The episode's token ids up to where its final answer's value starts, and that value."""
    from nemo_orchestra.data.default_tasks import plan_text

    name, args, _ = ep.turns[-1]
    text = plan_text(ep.task.category, ep.task.meta.get("preference_name"), name, args) + format_tool_call(name, args)
    turn = chat.encode(text) + [chat.end_of_turn_id]
    start = len(traj.token_ids) - len(turn)
    assert traj.token_ids[start:] == turn
    value = args["answer"]
    return traj.token_ids[:start] + chat.encode(text[: text.rindex(value)]), value


def test_the_warm_start_alone_copies_a_number_from_an_observation(tmp_path):
    cfg = load_config(
        [
            f"run.output_dir={tmp_path}",
            "rollout.engine=megatron",
            "warm_start.steps=200",
            "warm_start.lr=1e-3",  # at 3e-3 the copy never forms
            "warm_start.min_lr_ratio=1.0",  # a constant rate: the copy forms after about 100 steps
            "warm_start.batch_size=4",
            "warm_start.num_episodes=64",
            "warm_start.copy_lessons=1024",
            "warm_start.copy_lessons_per_step=32",
            "evaluation.enabled=false",
            "export.enabled=false",
            "logger.tensorboard=false",
        ]
    )
    info = init_distributed(cfg.parallel, cfg.run.seed)
    with ExitStack() as stack:
        trainer = build_trainer(cfg, info, stack)
        stack.callback(trainer.close)
        trainer.warm_start()
        chat = trainer.rollouts.episodes.chat
        tasks = [t for t in copy_tasks(96, seed=777) if t.category == "arithmetic"]  # unseen results
        episodes = trainer.loop.run_until_complete(scripted_episodes(tasks, trainer.client, seed=1, copy=True))
        prompts, values = [], []
        for ep in episodes:
            assert ep.turns[0][0] == "calculator" and ep.turns[-1][1] == {"answer": ep.turns[0][2]}
            ep.copy = False  # the real episode format: the prompt carries the tool schemas
            ids, value = _answer_prefix(chat, to_trajectory(ep, chat, cfg.reward), ep)
            prompts.append(ids)
            values.append(value)
        gens = trainer.generation.engine.generate(prompts, 16, 0.0, 1.0, [chat.end_of_turn_id])
    written = [re.match(r"-?\d*", chat.decode(g.token_ids)).group(0) for g in gens]
    copied = sum(w == v for w, v in zip(written, values))
    assert len(values) == 32 and copied >= 4, list(zip(values, written))
