"""Checkpoints: model, optimizer, RNG states, data position and step, written atomically.

A checkpoint is a folder ``step_XXXXXXXX`` holding one ``rank_XXXXX.pt`` per rank and a
``meta.json``; it is written under a temporary name and renamed into place, so a crash
mid-write leaves the previous checkpoint usable. ``latest`` names the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import torch
import torch.distributed as dist


def save_checkpoint(root: str, step: int, policy, extra: dict, keep: int, rank: int) -> str:
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    _barrier()
    state = {
        "model": policy.module.state_dict(),
        "reference": policy.reference.state_dict(),
        "optimizer": policy.optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "step": step,
        **extra,
    }
    torch.save(state, os.path.join(tmp, f"rank_{rank:05d}.pt"))
    _barrier()
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size() if dist.is_initialized() else 1}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(os.path.basename(final))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        for old in sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))[:-keep]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    _barrier()
    return final


def latest_checkpoint(root: str) -> str | None:
    path = os.path.join(root, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        folder = os.path.join(root, f.read().strip())
    return folder if os.path.isdir(folder) else None


def load_checkpoint(folder: str, policy, rank: int) -> dict:
    state = torch.load(os.path.join(folder, f"rank_{rank:05d}.pt"), map_location="cpu", weights_only=False)
    policy.module.load_state_dict(state["model"], strict=False)
    policy.reference.load_state_dict(state["reference"], strict=False)
    policy.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
