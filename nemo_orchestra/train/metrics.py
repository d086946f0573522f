"""One metric logger: rank-0 JSON lines in the run folder plus a one-line summary via logging."""

from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger("nemo_orchestra")

SUMMARY_KEYS = ("reward/mean", "reward/outcome", "rollout/cost_mean", "rollout/turns_mean",
                "loss/kl", "perf/tokens_per_s", "time/step_s")


class MetricLogger:
    def __init__(self, output_dir: str, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            self._f = open(self.path, "a", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in sorted(metrics.items())}}
        self._f.write(json.dumps(row) + "\n")
        shown = "  ".join(f"{k}={row[k]:.4g}" for k in SUMMARY_KEYS if isinstance(row.get(k), (int, float)))
        log.info("step %d  %s", step, shown)

    def close(self) -> None:
        if self.enabled:
            self._f.close()


def _plain(v):
    if hasattr(v, "item"):
        return v.item()
    return v


def setup_logging(level: str, rank: int) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO) if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s", datefmt="%H:%M:%S",
    )
    logging.getLogger("megatron").setLevel(logging.WARNING)  # it logs every parameter name at INFO
