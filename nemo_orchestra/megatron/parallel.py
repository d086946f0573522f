"""Process groups: torch.distributed + Megatron-Core model parallel state, on GPU or CPU."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nemo_orchestra.config import ParallelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: ParallelConfig, seed: int) -> DistInfo:
    """Start torch.distributed (a 1-rank group without torchrun) and Megatron's parallel state."""
    if not torch.cuda.is_available():
        from nemo_orchestra.megatron import cpu_compat

        cpu_compat.install()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world % (cfg.tp * cfg.pp) != 0:
        raise ValueError(f"parallel.tp x parallel.pp = {cfg.tp * cfg.pp} must divide the world size {world}")
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend=nccl needs CUDA; use gloo on a CPU machine")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        init_method = None
        if world == 1 and "MASTER_PORT" not in os.environ:  # a private port, not left in the environment
            init_method = f"tcp://127.0.0.1:{_free_port()}"  # (child processes would inherit it)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=cfg.collective_timeout_s),  # a collective a rank never joins fails then
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp,
            pipeline_model_parallel_size=cfg.pp,
        )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    info = DistInfo(rank, world, local_rank, cfg.tp, cfg.pp, world // (cfg.tp * cfg.pp), device)
    log.info("distributed: %s", info)
    return info


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def comm_device() -> torch.device:
    """Where tensors for collectives live: the current GPU under NCCL, else the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def model_parallel_rank() -> int:
    """Rank within this replica's tensor x pipeline group (0 on one rank)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0
    return dist.get_rank(group=ps.get_model_parallel_group())


def broadcast_in_model_parallel_group(obj):
    """``obj`` from the first rank of this replica's model-parallel group, on all its ranks.

    Ranks of one replica must train on the same data: rollouts are made once per replica and
    shared (any picklable object; a no-op without tensor/pipeline parallelism).
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return obj
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group=group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[0], group=group)
    return box[0]


def data_parallel_sum(values: list[float]) -> list[float]:
    """Element-wise sum over the data-parallel group (float64)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_data_parallel_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return t.tolist()


def data_parallel_gather(obj) -> list:
    """One object per data-parallel rank, in rank order, on every rank."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_data_parallel_world_size() == 1:
        return [obj]
    out = [None] * ps.get_data_parallel_world_size()
    dist.all_gather_object(out, obj, group=ps.get_data_parallel_group())
    return out


def once_per_node(make, path: str):
    """``make()`` on local rank 0 of each node; the node's other ranks get its (JSON) result.

    The result goes through ``<path>.node<N>.json`` (written atomically, read after a barrier),
    e.g. the URLs of the one tool-service replica a node's ranks share. Collective.
    """
    import json

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    node = int(os.environ.get("GROUP_RANK", dist.get_rank() // local_world))
    file = f"{path}.node{node}.json"
    value = None
    if local_rank == 0:
        value = make()
        os.makedirs(os.path.dirname(file) or ".", exist_ok=True)
        with open(file + ".tmp", "w") as f:
            json.dump(value, f)
        os.replace(file + ".tmp", file)
    dist.barrier()
    if local_rank != 0:
        with open(file) as f:
            value = json.load(f)
    return value
