"""Where the vLLM engine's memory lives: its GPU or its CPU cores (pinning), and the layout of weights handed over
without files (shared-memory segments on CPU, CUDA IPC buckets on GPU). Used by ``vllm.py``."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from contextlib import contextmanager

import psutil
import torch

log = logging.getLogger(__name__)


def layout(hf: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[list, int]:
    """(specs, bytes) of ``hf`` packed back to back in ``dtype``: specs are (name, shape, dtype name,
    byte offset), each offset aligned to 64 bytes."""
    specs, off = [], 0
    name = str(dtype).removeprefix("torch.")
    for k, v in hf.items():
        specs.append((k, list(v.shape), name, off))
        off += -(-v.numel() * dtype.itemsize // 64) * 64
    return specs, off


def sizes(specs: list) -> list[int]:
    import math

    return [math.prod(shape) * getattr(torch, dtype).itemsize for _, shape, dtype, _ in specs]


def buckets(hf: dict[str, torch.Tensor], dtype: torch.dtype, limit: int):
    """``hf`` in consecutive dicts of at most ``limit`` bytes (a larger tensor goes alone)."""
    bucket, size = {}, 0
    for k, v in hf.items():
        n = v.numel() * dtype.itemsize
        if bucket and size + n > limit:
            yield bucket
            bucket, size = {}, 0
        bucket[k] = v
        size += n
    if bucket:
        yield bucket


def engine_visible_devices(local_rank: int, visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the engine of local rank ``local_rank``: the one GPU the rank
    trains on, named as the parent sees it (``visible``, the launcher's own list, or all GPUs)."""
    gpus = [g.strip() for g in visible.split(",") if g.strip()] if visible else None
    if gpus is None:
        return str(local_rank)
    if local_rank >= len(gpus):
        raise ValueError(f"local rank {local_rank} has no GPU: CUDA_VISIBLE_DEVICES={visible}")
    return gpus[local_rank]


SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path, less its NUL) on Linux
IPC_NAME = 36  # vLLM names each socket by a uuid4: VLLM_RPC_BASE_PATH/<36 characters>


def ipc_folder() -> str:
    """A new folder for vLLM's ZMQ socket files (``VLLM_RPC_BASE_PATH``; vLLM leaves them behind), in
    the temp folder, or in /tmp where the temp folder's path is too long for a socket's path (a
    cluster's TMPDIR can be): a path past ``SOCKET_PATH_MAX`` stops vLLM at start."""
    folder = tempfile.mkdtemp(prefix="vllm-ipc-")
    if len(os.fsencode(folder)) + 1 + IPC_NAME <= SOCKET_PATH_MAX:
        return folder
    os.rmdir(folder)
    return tempfile.mkdtemp(prefix="vllm-ipc-", dir="/tmp")


@contextmanager
def env_defaults(**wanted: str):
    """The environment variables of ``wanted`` that are not set, set for the block (processes started
    inside inherit them); a variable already set is left as it is."""
    added = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextmanager
def pinned_to(device: torch.device, cpus: list[int] | None = None):
    """Processes started inside see only ``device``'s GPU (on CUDA); on a CPU with ``cpus``, every thread
    of the processes started inside runs on those cores (vLLM's worker binds its compute threads
    there, ``VLLM_CPU_OMP_THREADS_BIND``; ``pin_new_processes`` the rest) and vLLM's processes spin
    only ``PINNED_SPIN_S`` after a message before they block, not vLLM's second (``vllm_plugin``:
    the reference pass takes the engine's idle cycles). A variable already set is left as it is."""
    if device.type != "cuda":
        if not cpus:
            yield
            return
        from nemo_orchestra.rollout.engines.vllm_plugin import ENV as SPIN_ENV, PINNED_SPIN_S, check_spin_env

        check_spin_env()
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        with env_defaults(VLLM_CPU_OMP_THREADS_BIND=",".join(str(c) for c in cpus), **{SPIN_ENV: str(PINNED_SPIN_S)}):
            yield
            pin_new_processes(before, cpus)
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = device.index if device.index is not None else torch.cuda.current_device()
    os.environ["CUDA_VISIBLE_DEVICES"] = engine_visible_devices(index, before)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def pin_new_processes(before: set[int], cpus: list[int]) -> None:
    """Every thread of this process's descendants not in ``before`` (the engine's: its engine core and
    its worker) runs on ``cpus`` only; threads they start later inherit it. vLLM binds only its
    worker's compute threads; its engine core, which schedules each step while the worker waits
    (no overlap on CPU), would otherwise run on the trainer's cores too."""
    failed = []
    for proc in psutil.Process().children(recursive=True):
        if proc.pid in before:
            continue
        try:
            threads = [t.id for t in proc.threads()]
        except psutil.NoSuchProcess:
            continue
        except psutil.Error as e:
            failed.append(f"{proc.pid}: {e}")
            continue
        for tid in threads:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
            except OSError as e:
                failed.append(f"{proc.pid}/{tid}: {e}")
    if failed:  # the engine still runs, only on any core: say so rather than slow down unexplained
        log.warning("the engine's threads could not all be pinned to cores %s (%s)", cpus, "; ".join(failed[:3]))


def close_segment(shm) -> None:
    try:
        shm.close()
        shm.unlink()
    except (FileNotFoundError, BufferError):
        pass


def remove(segments: list, *folders: str) -> None:
    for f in folders:
        shutil.rmtree(f, ignore_errors=True)
    for shm in segments:
        close_segment(shm)
