"""Training checkpoints: model, reference, optimizer, LR, RNG states, data position and step.

A checkpoint is a folder ``step_XXXXXXXX`` in the distributed format of
``megatron/dist_ckpt.py`` (every rank writes its shards; loadable under another TP/PP/DP
layout), plus ``rng_rank_XXXXX.pt`` per rank and ``nemo_orchestra.json``. It is written under
``step_XXXXXXXX.tmp`` and renamed into place once every rank has finished, then ``latest`` is
replaced atomically: a crash mid-write leaves the previous checkpoint (and ``latest``) usable.
The newest ``checkpoint.keep`` checkpoints are kept.

RNG states are restored when the layout (world size, TP, PP) is the same; under another layout
each rank keeps its seeded state (a warning says so).
"""

from __future__ import annotations

import logging
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from nemo_orchestra.megatron import dist_ckpt

log = logging.getLogger(__name__)


def save_checkpoint(root: str, step: int, policy, extra: dict, keep: int, rank: int, model_cfg=None,
                    vocab_size: int = 0) -> str:
    """Write ``root/step_XXXXXXXX`` (collective: every rank calls it). ``extra`` goes to the common state."""
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dist_ckpt.save(tmp, policy=policy, common={"step": step, **extra})  # needs an empty folder
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank_{rank:05d}.pt"))
    _barrier()
    if rank == 0:
        if model_cfg is not None:
            dist_ckpt.write_meta(tmp, model_cfg, vocab_size, step=step, layout=_layout())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(os.path.basename(final))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        _prune(root, keep)
    _barrier()
    return final


def _prune(root: str, keep: int) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    for d in os.listdir(root):  # leftovers of a write that crashed
        if d.endswith(".tmp") and os.path.isdir(os.path.join(root, d)):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def latest_checkpoint(root: str) -> str | None:
    path = os.path.join(root, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        folder = os.path.join(root, f.read().strip())
    return folder if os.path.isdir(folder) else None


def load_checkpoint(folder: str, policy, rank: int) -> dict:
    """Restore the policy in place; returns the common state (``step``, data position, ...)."""
    common = dist_ckpt.load(folder, policy)
    meta = dist_ckpt.read_meta(folder) if os.path.isfile(os.path.join(folder, dist_ckpt.META)) else {}
    rng_file = os.path.join(folder, f"rng_rank_{rank:05d}.pt")
    if meta.get("layout") == _layout() and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    elif rank == 0:
        log.warning("checkpoint layout %s differs from this run's %s: RNG states are not restored",
                    meta.get("layout"), _layout())
    return common


def rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    world = dist.get_world_size() if dist.is_initialized() else 1
    if not ps.model_parallel_is_initialized():
        return {"world": world, "tp": 1, "pp": 1}
    return {"world": world, "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size()}


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
