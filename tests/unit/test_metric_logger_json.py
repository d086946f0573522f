"""metrics.jsonl stays strict JSON when a step's figures are not finite (a skipped step's loss):
NaN and infinities are written as ``null``; TensorBoard still gets the float."""

import json
import math

import pytest

from nemo_orchestra.config import LoggerConfig
from nemo_orchestra.train.metric_logger import MetricLogger


def _strict(line: str) -> dict:
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(line, parse_constant=refuse)


def _cfg(tensorboard: bool) -> LoggerConfig:
    return LoggerConfig(
        tensorboard=tensorboard, wandb=False, wandb_project="p", wandb_run_name=None, wandb_mode="offline"
    )


def test_the_strict_parser_refuses_what_python_writes_by_default():
    with pytest.raises(ValueError, match="NaN"):
        _strict(json.dumps({"x": math.nan}))


def test_non_finite_values_are_null_in_metrics_jsonl(tmp_path):
    logger = MetricLogger(str(tmp_path), cfg=_cfg(tensorboard=False))
    logger.log(1, {"loss/kl": 0.5, "train/grad_norm": 1.25, "data/task_ids": ["a"]})
    logger.log(2, {"loss/kl": math.nan, "train/grad_norm": math.inf, "loss/pg": -math.inf, "data/task_ids": ["b"]})
    logger.close()
    rows = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss/kl"] == 0.5 and rows[0]["train/grad_norm"] == 1.25
    assert rows[1]["loss/kl"] is None and rows[1]["train/grad_norm"] is None and rows[1]["loss/pg"] is None
    assert rows[1]["data/task_ids"] == ["b"] and rows[1]["step"] == 2


def test_tensorboard_still_gets_the_float(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricLogger(str(tmp_path), cfg=_cfg(tensorboard=True))
    logger.log(1, {"loss/kl": math.nan, "reward/mean": 0.25})
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert math.isnan(acc.Scalars("loss/kl")[0].value) and acc.Scalars("reward/mean")[0].value == 0.25
