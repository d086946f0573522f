"""Copy lessons in GRPO steps (loss.copy_lesson_coef): which lessons a step draws, where they go in the
update's batch, and the config keys."""

import pytest

from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.train.packing import pack
from nemo_orchestra.train.warm_start import interleave, step_lessons
from tests.helpers import traj


def _drawn(coef, n, lessons, step, seed=1234, dp_rank=0):
    cfg = load_config([f"loss.copy_lesson_coef={coef}", f"loss.copy_lessons_per_step={n}", f"run.seed={seed}"])
    return step_lessons(lessons, cfg, step, dp_rank)


def _lessons(k=40):
    return [traj(ids=[1, 2, 3, 4 + i], mask=[0, 0, 1, 1]) for i in range(k)]


def test_a_step_draws_its_lessons_from_seed_step_and_rank_with_the_coefficient_as_advantage():
    lessons = _lessons()
    step = lambda s, **kw: _drawn(0.5, 8, lessons, s, **kw)  # noqa: E731
    drawn = step(3)
    assert len(drawn) == 8 and all(t.advantage == 0.5 and t.meta["lesson"] for t in drawn)
    assert [t.token_ids for t in drawn] == [t.token_ids for t in step(3)]  # a resumed run draws the same
    assert [t.token_ids for t in drawn] != [t.token_ids for t in step(4)]
    assert [t.token_ids for t in drawn] != [t.token_ids for t in step(3, dp_rank=1)]
    assert all(t.advantage == 0.0 and "lesson" not in t.meta for t in lessons)  # the warm start's own untouched
    (b,) = pack(drawn[:1] + lessons[:1], capacity=16)
    assert b.lesson_T.tolist() == [1.0] * 4 + [0.0] * 4


@pytest.mark.parametrize("coef,n,lessons", [(0.0, 8, _lessons()), (1.0, 0, _lessons()), (1.0, 8, [])])
def test_no_lessons_when_off_or_when_the_run_has_none(coef, n, lessons):
    assert _drawn(coef, n, lessons, 1) == []


def test_at_most_the_lessons_there_are():
    assert len(_drawn(1.0, 8, _lessons(3), 1)) == 3


def test_lessons_are_spread_over_the_batch_so_every_minibatch_gets_some():
    merged = interleave(list("abcdefgh"), [1, 2])
    assert [x for x in merged if isinstance(x, str)] == list("abcdefgh")
    assert [x for x in merged if isinstance(x, int)] == [1, 2]
    assert merged.index(1) < 4 <= merged.index(2)  # one in each half (loss.minibatches=2)
    assert interleave([], [1, 2]) == [1, 2] and interleave(["a"], []) == ["a"]


def test_config_keys():
    cfg = load_config([])
    assert cfg.loss.copy_lesson_coef >= 0 and cfg.loss.copy_lessons_per_step > 0
    for bad in ("loss.copy_lesson_coef=-1", "loss.copy_lessons_per_step=-2"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config([bad])


def test_a_restatement_that_finds_no_one_token_plan_says_so_once(caplog):
    """``loss.restatement_coef`` on tasks without a plan head (no preference profile; likewise a tokenizer that
    writes plans in several tokens) trains nothing: the trainer says so once, not every step, and with the
    coefficient at 0 it reads no plan."""
    from types import SimpleNamespace

    from nemo_orchestra.train.trainer import Trainer

    cfg = load_config(["loss.restatement_coef=5.0"])
    me = SimpleNamespace(
        cfg=cfg, rollouts=SimpleNamespace(episodes=SimpleNamespace(chat=None)), plans_unseen_said=False
    )
    trajs = [traj() for _ in range(3)]  # tasks of no kind or profile
    with caplog.at_level("WARNING", logger="nemo_orchestra.train.trainer"):
        Trainer.mark_plans(me, trajs)
        Trainer.mark_plans(me, trajs)
    said = [r for r in caplog.records if "restatement_coef=5 trains nothing" in r.getMessage()]
    assert len(said) == 1 and all(t.plans == [] for t in trajs)
    me = SimpleNamespace(cfg=load_config(["loss.restatement_coef=0"]), plans_unseen_said=False)  # no rollouts read
    Trainer.mark_plans(me, trajs)
    assert not me.plans_unseen_said
