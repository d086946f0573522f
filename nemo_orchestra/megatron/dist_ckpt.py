"""Distributed checkpoints through Megatron-Core ``dist_checkpointing`` (the torch_dist format).

Each rank writes its own shards; tensors are stored by global name, shape and offset, so a
checkpoint loads under any TP/PP/DP layout (Megatron reshards on load). The folder holds:

- ``model.*``: the policy's weights; ``reference.*``: the frozen KL reference (training checkpoints);
- ``optimizer``: the distributed optimizer's state in the ``fully_reshardable`` format
  (gathered per DP group on save, each rank reads the slices it owns on load);
- ``common``: small non-tensor state (step, data position, LR), saved once;
- ``nemo_orchestra.json``: the model config and vocabulary size, read without torch.distributed.

Megatron's torch-Adam fallback (no TransformerEngine/Apex, e.g. on CPU) keeps a per-parameter
``step`` that its checkpoint code does not expect; ``_torch_adam_fixes`` covers that.

Megatron's checkpoint writer collects its results through a ``multiprocessing`` manager, a
process it spawns at the first save and never stops; a trainer killed with SIGKILL would leave
it (and its resource tracker) running. ``_results_queue_dying_with_us`` starts that manager
itself, with a parent-death signal on Linux, so it ends with the trainer however it dies.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys

import torch

META = "nemo_orchestra.json"
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def is_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "metadata.json")) and os.path.isfile(os.path.join(folder, META))


def read_meta(folder: str) -> dict:
    with open(os.path.join(folder, META)) as f:
        return json.load(f)


def write_meta(folder: str, model_cfg, vocab_size: int, **extra) -> None:
    meta = {"model": dataclasses.asdict(model_cfg), "vocab_size": vocab_size, **extra}
    with open(os.path.join(folder, META), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


def check_model_config(folder: str, model_cfg) -> None:
    from nemo_orchestra.config import ModelConfig
    from nemo_orchestra.megatron.model import check_same_architecture

    found = ModelConfig(
        **{
            k: v
            for k, v in read_meta(folder)["model"].items()
            if k in {f.name for f in dataclasses.fields(ModelConfig)}
        }
    )
    check_same_architecture(found, model_cfg, folder)


def model_sharded(gpt, prefix: str = "model.") -> dict:
    return gpt.sharded_state_dict(prefix=prefix)


def load_model(gpt, folder: str, prefix: str = "model.") -> None:
    """Only the model weights of a checkpoint (an import or a training checkpoint), resharded."""
    from megatron.core import dist_checkpointing

    from nemo_orchestra.megatron.cpu_compat import on_cpu

    with on_cpu():
        loaded = dist_checkpointing.load({"model": model_sharded(gpt, prefix)}, folder)
    _load_module(gpt, loaded["model"], prefix)


def _die_with(parent_pid: int) -> None:
    """In a child process: receive SIGKILL when the thread that started it exits (Linux prctl)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(0)


def _results_queue_dying_with_us() -> None:
    """Give Megatron's async writer its results queue from a manager that dies with this process."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(_die_with, (os.getpid(),))
        filesystem_async._results_queue = manager.Queue()
        filesystem_async._results_manager = manager  # keep it referenced for the process's life


def save(folder: str, policy=None, gpt=None, common: dict | None = None) -> None:
    """Write the policy (model, reference, optimizer) or a bare model, plus ``common``. Collective."""
    from megatron.core import dist_checkpointing

    from nemo_orchestra.megatron.cpu_compat import on_cpu

    _torch_adam_fixes()
    _results_queue_dying_with_us()
    with on_cpu():
        if policy is not None:
            ensure_optimizer_state(policy.optimizer)
            state = {"model": model_sharded(policy.module), "reference": model_sharded(policy.reference, "reference.")}
            state["optimizer"] = policy.optimizer.sharded_state_dict(state["model"], metadata=OPTIM_METADATA)
        else:
            state = {"model": model_sharded(gpt)}
        state["common"] = common or {}
        dist_checkpointing.save(state, folder)


def load(folder: str, policy) -> dict:
    """Restore model, reference and optimizer in place; returns the checkpoint's ``common`` dict."""
    from megatron.core import dist_checkpointing

    from nemo_orchestra.megatron.cpu_compat import on_cpu

    _torch_adam_fixes()
    with on_cpu():
        ensure_optimizer_state(policy.optimizer)
        state = {"model": model_sharded(policy.module), "reference": model_sharded(policy.reference, "reference.")}
        state["optimizer"] = policy.optimizer.sharded_state_dict(
            state["model"], is_loading=True, metadata=OPTIM_METADATA
        )
        loaded = dist_checkpointing.load(state, folder)
        _load_module(policy.module, loaded["model"], "model.")
        _load_module(policy.reference, loaded["reference"], "reference.")
        policy.optimizer.load_state_dict(loaded["optimizer"])
        unshare_adam_steps(policy.optimizer)
    return loaded.get("common", {})


def _load_module(module, loaded: dict, prefix: str) -> None:
    state = {k[len(prefix) :]: v for k, v in loaded.items()}
    module.load_state_dict(state, strict=True)


def ensure_optimizer_state(optimizer) -> None:
    """Torch Adam creates its state at the first step; Megatron's checkpointing needs it to exist.

    A step with zero gradients at learning rate 0 creates it without changing any weight.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or len(inner.state) > 0 or not hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            continue
        lrs = [g["lr"] for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
        opt._init_optimizer_states_with_dummy_values()
        for g, lr in zip(inner.param_groups, lrs):
            g["lr"] = lr


def unshare_adam_steps(optimizer) -> None:
    """Megatron restores torch Adam's per-parameter ``step`` as one tensor shared by every
    parameter; Adam increments it in place once per parameter, which would skew the bias
    correction of all but the first. Give each parameter its own copy."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in inner.state.values() if inner is not None else []:
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


_fixed = False


def _torch_adam_fixes() -> None:
    """Without TE/Apex, Megatron's distributed optimizer runs torch Adam, whose per-parameter
    ``step`` is not among the tensors a ``fully_reshardable`` checkpoint carries (Megatron restores
    it separately, from the param groups): copy only the tensors the checkpoint has."""
    global _fixed
    from megatron.core.optimizer import distrib_optimizer as dopt

    if _fixed or getattr(dopt, "HAVE_APEX_OR_TE", True):
        return

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        for key, t in dst.items():
            if key in tensors:
                t.copy_(tensors[key])

    if not dopt.DistributedOptimizer.__dict__.get("_nemo_orchestra_fixed"):
        original = dopt.DistributedOptimizer._set_main_param_and_optimizer_states

        def patched(self, model_param, tensors):
            if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                return original(self, model_param, tensors)
            return set_states(self, model_param, tensors)

        dopt.DistributedOptimizer._set_main_param_and_optimizer_states = patched
        dopt.DistributedOptimizer._nemo_orchestra_fixed = True
    _fixed = True
