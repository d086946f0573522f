"""The data order and its position: a resume at another data-parallel size continues the epoch, no
prompt drawn twice and none skipped."""

import random

import pytest

from nemo_orchestra.train.data_order import DataOrder, DataPosition, rank_indices

SEED = 1234


def _step_based(step, n_tasks, per_rank, dp, rank):
    """The order as a step number alone decided it: right for a run that never changes its size."""
    per_epoch = n_tasks // (per_rank * dp)
    epoch, k = divmod(step, per_epoch)
    order = list(range(n_tasks))
    random.Random(SEED + epoch).shuffle(order)
    start = (k * dp + rank) * per_rank
    return order[start : start + per_rank]


def _order(n_tasks, per_rank, dp, rank, start=(0, DataPosition())):
    return DataOrder(list(range(n_tasks)), per_rank, SEED, dp, rank, start)


def _drawn(n_tasks, per_rank, dp, steps, start_step=0, start=DataPosition()):
    """Every rank's prompts, step by step, from ``start`` at ``start_step``."""
    ranks = [_order(n_tasks, per_rank, dp, r, (start_step, start)) for r in range(dp)]
    return [[i for t in ranks for i in t.tasks_at(s)] for s in range(start_step, start_step + steps)]


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_an_uninterrupted_run_draws_as_the_step_alone_decided(dp):
    n_tasks, per_rank = 50, 4  # 50 is no multiple of a step: each epoch drops its remainder
    for step in range(30):
        for rank in range(dp):
            t = _order(n_tasks, per_rank, dp, rank)
            assert t.tasks_at(step) == _step_based(step, n_tasks, per_rank, dp, rank)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3)])
def test_a_resume_at_another_data_parallel_size_continues_the_epoch(before, after):
    n_tasks, per_rank = 48, 4
    saved_at = 3  # steps run at the first size
    first = _drawn(n_tasks, per_rank, before, saved_at)
    pos = _order(n_tasks, per_rank, before, 0).position(saved_at)  # what the checkpoint records
    pos = DataPosition.saved(pos.to_dict(), saved_at, n_tasks, per_rank * after)
    rest_of_epoch = (n_tasks - pos.offset) // (per_rank * after)
    *second, next_step = _drawn(n_tasks, per_rank, after, rest_of_epoch + 1, saved_at, pos)
    epoch = [i for step in first + second for i in step]
    assert len(epoch) == len(set(epoch)), "a prompt drawn twice in one epoch"
    assert n_tasks - len(epoch) < per_rank * after  # nothing skipped but the remainder that fills no step
    order = list(range(n_tasks))
    random.Random(SEED).shuffle(order)
    assert epoch == order[: len(epoch)]  # in the epoch's order, from where the first size stopped
    order1 = list(range(n_tasks))
    random.Random(SEED + 1).shuffle(order1)
    assert next_step == order1[: per_rank * after]  # then the next epoch from its start


def test_a_checkpoint_that_recorded_the_step_is_read_as_that_many_steps():
    pos = DataPosition.saved(5, 5, 50, 8)  # 6 steps of 8 fill an epoch of 50
    assert pos == DataPosition().advance(5, 50, 8) == DataPosition(0, 40)
    assert DataPosition.saved(7, 7, 50, 8) == DataPosition(1, 8)
    assert DataPosition.saved({"epoch": 2, "offset": 16}, 99, 50, 8) == DataPosition(2, 16)


def test_too_few_tasks_for_a_step_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one step's 4 prompts x 3 data-parallel ranks"):
        _order(10, 4, 3, 0).tasks_at(0)
    with pytest.raises(ValueError, match="fewer than one step's 12 prompts"):
        rank_indices(DataPosition(), 10, 4, 3, 0, SEED)
