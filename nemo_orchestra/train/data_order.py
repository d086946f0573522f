"""The order a run draws its training prompts in, and its position in that order.

Each epoch is a permutation of the training tasks seeded by ``run.seed + epoch``. A step takes the next
``data.prompts_per_step`` x data-parallel-size prompts of it, rank r the r-th slice of
``prompts_per_step``; what is left of an epoch that does not fill a step is not drawn. The position is
saved as (epoch, prompts consumed in it), not as the step: a run resumed at another data-parallel size
continues the epoch where the saved run stopped, no prompt drawn twice and none skipped.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DataPosition:
    epoch: int = 0
    offset: int = 0  # prompts of the epoch's permutation already drawn

    def to_dict(self) -> dict:
        return asdict(self)

    def advance(self, steps: int, n_tasks: int, per_step: int) -> DataPosition:
        """The position ``steps`` steps of ``per_step`` prompts (all ranks together) later."""
        check_fits(n_tasks, per_step)
        left = (n_tasks - self.offset) // per_step  # steps the current epoch still fills
        if steps < left:
            return DataPosition(self.epoch, self.offset + steps * per_step)
        per_epoch = n_tasks // per_step
        rest = steps - left
        return DataPosition(self.epoch + 1 + rest // per_epoch, (rest % per_epoch) * per_step)

    @classmethod
    def saved(cls, value, step: int, n_tasks: int, per_step: int) -> DataPosition:
        """The position a checkpoint recorded: a dict, or (older checkpoints) the step number, read as
        that many steps at this run's data-parallel size."""
        if isinstance(value, dict):
            return cls(int(value["epoch"]), int(value["offset"]))
        return cls().advance(int(step if value is None else value), n_tasks, per_step)


@dataclass
class DataOrder:
    """The training prompts of each step on this data-parallel rank: the step's position is ``start``
    (a fresh run's step 0, or the resumed checkpoint's step and position) advanced by the steps since."""

    tasks: list  # the training task records
    prompts_per_step: int  # data.prompts_per_step, per rank
    seed: int  # run.seed
    dp_size: int = 1
    dp_rank: int = 0
    start: tuple[int, DataPosition] = (0, DataPosition())

    def position(self, step: int) -> DataPosition:
        """Where step ``step`` draws its prompts."""
        n = self.prompts_per_step
        if len(self.tasks) < n * self.dp_size:
            raise ValueError(
                f"data: {len(self.tasks)} tasks are fewer than one step's "
                f"{n} prompts x {self.dp_size} data-parallel ranks"
            )
        base_step, base = self.start
        return base.advance(step - base_step, len(self.tasks), n * self.dp_size)

    def tasks_at(self, step: int) -> list:
        """This rank's prompts of step ``step``."""
        idx = rank_indices(
            self.position(step), len(self.tasks), self.prompts_per_step, self.dp_size, self.dp_rank, self.seed
        )
        return [self.tasks[i] for i in idx]

    def resume(self, step: int, saved) -> None:
        """Continue from a checkpoint of step ``step`` whose data position was ``saved``."""
        self.start = (step, DataPosition.saved(saved, step, len(self.tasks), self.prompts_per_step * self.dp_size))


def check_fits(n_tasks: int, per_step: int) -> None:
    if n_tasks < per_step:
        raise ValueError(
            f"data: {n_tasks} tasks are fewer than one step's {per_step} prompts (all data-parallel ranks)"
        )


def rank_indices(pos: DataPosition, n_tasks: int, per_rank: int, dp_size: int, dp_rank: int, seed: int) -> list[int]:
    """The task indices rank ``dp_rank`` of ``dp_size`` trains on at ``pos``."""
    per_step = per_rank * dp_size
    if pos.offset + per_step > n_tasks:  # a position past the end of its epoch starts the next one
        pos = DataPosition(pos.epoch + 1, 0)
    check_fits(n_tasks, per_step)
    order = list(range(n_tasks))
    random.Random(seed + pos.epoch).shuffle(order)
    start = pos.offset + dp_rank * per_rank
    return order[start : start + per_rank]
