"""One metric logger: rank-0 JSON lines in the run folder, TensorBoard scalars beside them, W&B when
asked, and a one-line summary via logging.

Every backend gets the same keys as ``metrics.jsonl``; a value that is not a number (``data/task_ids``,
a list of the prompts a step used) is kept in ``metrics.jsonl`` only. A NaN or an infinity (a
skipped step's loss) is ``null`` in ``metrics.jsonl``, which stays strict JSON; TensorBoard and W&B
get the float.
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import time
import uuid
from typing import Any

from nemo_orchestra.config import LoggerConfig

log = logging.getLogger("nemo_orchestra")

SUMMARY_KEYS = (
    ("reward/mean", "reward"),
    ("reward/outcome", "acc"),
    ("rollout/cost_mean", "cost"),
    ("rollout/turns_mean", "turns"),
    ("loss/kl", "kl"),
    ("perf/tokens_per_s", "tok/s"),
    ("time/step_s", "s"),
)
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"  # a resumed run continues the same W&B run


class MetricLogger:
    def __init__(
        self, output_dir: str, enabled: bool = True, cfg: LoggerConfig | None = None, run_config: dict | None = None
    ):
        self.enabled = enabled
        self.output_dir = output_dir
        self.cfg = cfg or LoggerConfig(
            tensorboard=True, wandb=False, wandb_project="nemo-orchestra", wandb_run_name=None, wandb_mode="offline"
        )
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._tb = None  # opened at the first step logged (see _tensorboard)
        self._wandb = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            self._f = open(self.path, "a", buffering=1)
            if self.cfg.wandb:
                self._wandb = start_wandb(self.cfg, output_dir, run_config or {})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in sorted(metrics.items())}}
        self._f.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")
        scalars = {k: float(v) for k, v in row.items() if k not in ("step", "time") and _is_scalar(v)}
        if self.cfg.tensorboard:
            writer = self._tensorboard(step)
            for k, v in scalars.items():
                writer.add_scalar(k, v, step, walltime=row["time"])
            writer.flush()  # a run killed later still leaves every step it logged
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        log.info("step %d  %s", step, summary_line(row))

    def _tensorboard(self, first_step: int):
        """The event writer, opened at the first logged step: ``purge_step`` drops the events a killed run
        logged past its last checkpoint, so a resumed run's curves do not double back."""
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(self.output_dir, TENSORBOARD_DIR), purge_step=first_step)
        return self._tb

    def close(self) -> None:
        if not self.enabled:
            return
        self._f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def summary_line(row: dict[str, Any]) -> str:
    """The few headline numbers of a step, compact: ``reward=0.41 acc=0.5 cost=0.00031 ...``."""
    return " ".join(f"{short}={row[k]:.3g}" for k, short in SUMMARY_KEYS if _is_scalar(row.get(k)))


def start_wandb(cfg: LoggerConfig, output_dir: str, run_config: dict):
    """A W&B run in ``<output_dir>/wandb``: online when an API key is configured (``WANDB_API_KEY`` or a
    ``wandb login``), else offline (``wandb sync <output_dir>/wandb/offline-run-*`` uploads it later)."""
    try:
        import wandb
    except ImportError:
        raise ValueError("logger.wandb=true needs the wandb package: pip install wandb") from None
    mode = cfg.wandb_mode if cfg.wandb_mode != "auto" else ("online" if _wandb_key_configured() else "offline")
    id_path = os.path.join(output_dir, WANDB_ID_FILE)
    run_id = open(id_path).read().strip() if os.path.exists(id_path) else uuid.uuid4().hex[:8]
    with open(id_path, "w") as f:
        f.write(run_id)
    run = wandb.init(
        project=cfg.wandb_project,
        name=cfg.wandb_run_name or os.path.basename(os.path.abspath(output_dir)),
        dir=output_dir,
        mode=mode,
        id=run_id,
        resume="allow",
        config=run_config,
        settings=wandb.Settings(silent=True, console="off"),
    )
    log.info("W&B run %s (%s) in %s", run_id, mode, run.dir)
    return run


def _wandb_key_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _is_scalar(v) -> bool:
    return isinstance(v, (int, float))


def _json_safe(v):
    """``v`` with every NaN or infinity as None: ``metrics.jsonl`` is strict JSON (``null``), which
    every parser reads; Python's ``NaN`` and ``Infinity`` tokens are not JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def _plain(v):
    if hasattr(v, "item"):
        return v.item()
    return v
