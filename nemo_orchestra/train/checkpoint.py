"""Training checkpoints: model, reference, optimizer, LR, RNG states, data position and step.

A checkpoint is a folder ``step_XXXXXXXX`` in the distributed format of
``megatron/dist_ckpt.py`` (every rank writes its shards; loadable under another TP/PP/DP
layout), plus ``rng_rank_XXXXX.pt`` per rank and ``nemo_orchestra.json``. It is written under
``step_XXXXXXXX.tmp`` and renamed into place once every rank has finished, then ``latest`` is
replaced atomically: a crash mid-write leaves the previous checkpoint (and ``latest``) usable.
The newest ``checkpoint.keep`` checkpoints are kept.

RNG states are restored when the layout (world size, TP, PP) is the same; under another layout
each rank keeps its seeded state (a warning says so).

Integrity: the last file written into a checkpoint is ``manifest.json`` (atomically: a temporary
file, fsync, rename), listing every other file with its size and sha256. ``verify_checkpoint``
checks a folder against it; ``load_checkpoint`` never loads a folder that fails (a missing or
unreadable manifest included). ``latest_checkpoint`` tries the checkpoints newest first and
falls back past any that fail, with a warning naming the file; when checkpoints exist but none
is intact it raises ``CheckpointError`` naming the newest one's bad file. Digests cost one read
of the checkpoint at save and at resume (threads, ~1 GB/s per core; on several ranks only rank 0
reads and broadcasts the verdict). A checkpoint written before manifests existed is refused
until sealed by hand (``python -m nemo_orchestra.train.checkpoint seal FOLDER``). A ``latest``
that names a missing or unreadable folder is reported, and the newest intact checkpoint is used.

Finite values only: a save whose weights or optimizer state hold a NaN or an infinity (a diverged
run) raises ``NonFiniteCheckpoint`` naming the first such tensor, before anything is written and
without moving ``latest``; a checkpoint holding one (from a version that saved it) is refused at load.

Disk space: before each save the free space is compared with the newest checkpoint's size (from
its manifest); a save that runs out of space anyway removes its partial folder. Both stop with
``CheckpointSpaceError``, one line naming the path and the bytes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

from nemo_orchestra.megatron import dist_ckpt

log = logging.getLogger(__name__)


def save_checkpoint(
    root: str,
    step: int,
    learner,
    extra: dict,
    keep: int,
    rank: int,
    model_cfg=None,
    vocab_size: int = 0,
    rng: dict | None = None,
) -> str:
    """Write ``root/step_XXXXXXXX`` (collective: every rank calls it). ``extra`` goes to the common state;
    ``rng`` is this rank's RNG state to store (default: the current one).

    A disk that cannot hold it stops the save with ``CheckpointSpaceError`` (one line: the path, the
    bytes needed and free) before writing when the last checkpoint's size is more than the free
    space, or when the write itself runs out of space; the partial folder is removed. Weights or
    optimizer state holding a NaN or an infinity (on any rank) stop it with ``NonFiniteCheckpoint``
    before anything is written (``check_finite``)."""
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    check_finite(learner, f"{final}: not written, and {os.path.join(root, 'latest')} left as it was")
    check_free_space(root)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    try:
        common = {"step": step, **extra}
        if hasattr(learner, "guard"):  # train/steps_skipped_total counts on across a resume
            common["steps_skipped_total"] = learner.guard.total
        dist_ckpt.save(tmp, policy=learner, common=common)  # needs an empty folder
        torch.save(rng if rng is not None else rng_state(), os.path.join(tmp, f"rng_rank_{rank:05d}.pt"))
        _barrier()
        if rank == 0:
            if model_cfg is not None:
                dist_ckpt.write_meta(tmp, model_cfg, vocab_size, step=step, layout=_layout())
            write_manifest(tmp)  # last: its presence says every file above is complete
    except Exception as e:
        if not _out_of_space(e):
            raise
        written = _folder_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSpaceError(
            f"{tmp}: no space left on device after {written} bytes; the checkpoint needs "
            f"{_needed(root, written)}, {_free(root)} bytes free (partial folder removed)"
        ) from None
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(os.path.basename(final))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        _prune(root, keep)
    _barrier()
    return final


class CheckpointSpaceError(OSError):
    """The checkpoint does not fit on its disk; the message names the path and the bytes."""


def checkpoint_bytes(folder: str) -> int:
    """The size of a sealed checkpoint, from its manifest."""
    return sum(size for size, _ in _read_manifest(folder).values())


def check_free_space(root: str) -> None:
    """Raise ``CheckpointSpaceError`` when the newest checkpoint of ``root`` is larger than the free space."""
    previous = _newest_sealed(root)
    if previous is None:
        return
    needed, free = checkpoint_bytes(previous), _free(root)
    if needed > free:
        raise CheckpointSpaceError(
            f"{root}: {free} bytes free, a checkpoint needs about {needed} "
            f"(the size of {os.path.basename(previous)}); free space or move run.output_dir"
        )


def _newest_sealed(root: str) -> str | None:
    for folder in _candidates(root) if os.path.isdir(root) else []:
        if os.path.isfile(os.path.join(folder, MANIFEST)):
            return folder
    return None


def _needed(root: str, written: int) -> str:
    previous = _newest_sealed(root)
    if previous is not None:
        return f"about {checkpoint_bytes(previous)} bytes (the size of {os.path.basename(previous)})"
    return f"more than {written} bytes"


def _free(root: str) -> int:
    return shutil.disk_usage(root).free


def _folder_bytes(folder: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(folder):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(dirpath, n))
            except OSError:
                pass
    return total


def _out_of_space(e: BaseException) -> bool:
    """ENOSPC anywhere in ``e``: itself, its causes, or the per-rank failures of torch's CheckpointException."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e) or f"[Errno {errno.ENOSPC}]" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def remove_checkpoints(root: str) -> list[str]:
    """Delete every checkpoint folder of ``root`` and ``latest``; returns the names removed."""
    if not os.path.isdir(root):
        return []
    names = sorted(d for d in os.listdir(root) if d.startswith("step_") or d in ("latest", "latest.tmp"))
    for name in names:
        path = os.path.join(root, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return names


def _prune(root: str, keep: int) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    for d in os.listdir(root):  # leftovers of a write that crashed
        if d.endswith(".tmp") and os.path.isdir(os.path.join(root, d)):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def load_checkpoint(folder: str, learner, rank: int) -> dict:
    """Restore the policy in place; returns the common state (``step``, data position, ...).
    Raises ``CheckpointError`` if the folder does not match its manifest, and ``NonFiniteCheckpoint``
    if what it holds is not finite (written by a diverged run, before saves refused that)."""
    if os.path.realpath(folder) not in _VERIFIED:
        verify_checkpoint(folder)
    common = dist_ckpt.load(folder, learner)
    check_finite(learner, f"{folder}: not loaded (saved by a run that had diverged; resume from an earlier one)")
    if hasattr(learner, "guard"):
        learner.guard.total = int(common.get("steps_skipped_total", 0))
    meta = dist_ckpt.read_meta(folder) if os.path.isfile(os.path.join(folder, dist_ckpt.META)) else {}
    rng_file = os.path.join(folder, f"rng_rank_{rank:05d}.pt")
    if meta.get("layout") == _layout() and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    elif rank == 0:
        log.warning(
            "checkpoint layout %s differs from this run's %s: RNG states are not restored",
            meta.get("layout"),
            _layout(),
        )
    return common


def rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
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
    return {
        "world": world,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
    }


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---- integrity: the manifest --------------------------------------------------------------------

MANIFEST = "manifest.json"
_VERIFIED: set[str] = set()  # folders verified by this process (resume verifies, then loads)
_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted; the message names the folder and the file."""


class NonFiniteCheckpoint(CheckpointError):
    """Weights or optimizer state holding a NaN or an infinity, refused at save and at load."""


def learner_tensors(learner):
    """(name, tensor) of what a checkpoint holds of the policy: weights, reference, optimizer state
    (moments and the fp32 main copies of low-precision weights)."""
    names = {}
    for prefix, module in (("model.", learner.module), ("reference.", learner.reference)):
        for name, p in module.named_parameters():
            names.setdefault(id(p), prefix + name)
            yield prefix + name, p
    for opt in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        inner = getattr(opt, "optimizer", None)
        main = _main_param_names(opt, names)
        for i, p in enumerate(q for group in getattr(inner, "param_groups", []) for q in group["params"]):
            label = names.get(id(p)) or main.get(id(p), f"parameter #{i}")
            if id(p) not in names:
                yield f"optimizer main copy of {label}", p
            for key, v in inner.state.get(p, {}).items():
                if torch.is_tensor(v):
                    yield f"optimizer {key} of {label}", v


def _main_param_names(opt, names: dict[int, str]) -> dict[int, str]:
    """The model parameter's name of each of a Megatron optimizer's main parameters (fp32 copies,
    or the distributed optimizer's shards), by ``id``."""
    out = {}
    pairs = (
        ("model_float16_groups", "shard_fp32_from_float16_groups"),  # distributed optimizer
        ("model_fp32_groups", "shard_fp32_groups"),
        ("float16_groups", "fp32_from_float16_groups"),  # Float16OptimizerWithFloat16Params
        ("fp32_from_fp32_groups", "fp32_from_fp32_groups"),
    )
    for model_attr, main_attr in pairs:
        for model_group, main_group in zip(getattr(opt, model_attr, None) or [], getattr(opt, main_attr, None) or []):
            for model_param, main_param in zip(model_group, main_group):
                if id(model_param) in names:
                    out.setdefault(
                        id(main_param), names[id(model_param)] + (" (shard)" if "shard" in main_attr else "")
                    )
    return out


def check_finite(learner, context: str) -> None:
    """Raise ``NonFiniteCheckpoint`` on every rank when the policy's weights or optimizer state hold a
    NaN or an infinity on any rank, naming the first such tensor (one ``isfinite`` pass per tensor;
    collective when torch.distributed is up)."""
    from nemo_orchestra.train.divergence import any_rank, first_non_finite

    bad = first_non_finite(learner_tensors(learner)) if learner is not None else None
    if not any_rank(bad is not None)[0]:
        return
    if dist.is_initialized() and dist.get_world_size() > 1:
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, bad)
        rank, bad = next((r, b) for r, b in enumerate(found) if b is not None)
        bad = f"{bad} (rank {rank})"
    raise NonFiniteCheckpoint(f"{context}: {bad} holds non-finite values (NaN or inf)")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(dirpath, n), folder) for n in names]
    return sorted(f for f in out if f != MANIFEST and not f.startswith(MANIFEST + ".tmp"))


def _digests(folder: str, names: list[str]) -> list[str]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda n: _sha256(os.path.join(folder, n)), names))


def write_manifest(folder: str) -> str:
    """List every file of ``folder`` with its size and sha256 in ``manifest.json``, atomically."""
    names = _files(folder)
    entries = {
        n: {"size": os.path.getsize(os.path.join(folder, n)), "sha256": d}
        for n, d in zip(names, _digests(folder, names))
    }
    path, tmp = os.path.join(folder, MANIFEST), os.path.join(folder, f"{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump({"version": 1, "files": entries}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(folder)
    return path


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{folder}: no {MANIFEST} (its save did not finish, or it predates manifests; "
            f"if you trust it: python -m nemo_orchestra.train.checkpoint seal {folder})"
        )
    try:
        with open(path) as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no files listed")
        return {n: (int(e["size"]), str(e["sha256"])) for n, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({type(e).__name__}: {e})") from None


def verify_checkpoint(folder: str) -> None:
    """Raise ``CheckpointError`` naming the first file of ``folder`` that is missing, of the
    wrong size or of the wrong sha256 according to its manifest (or the manifest itself)."""
    expected = _read_manifest(folder)
    for name, (size, _) in sorted(expected.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        if os.path.getsize(path) != size:
            raise CheckpointError(f"{path}: {os.path.getsize(path)} bytes, {MANIFEST} says {size} (truncated?)")
    names = sorted(expected)
    for name, digest in zip(names, _digests(folder, names)):
        if digest != expected[name][1]:
            raise CheckpointError(f"{os.path.join(folder, name)}: sha256 differs from {MANIFEST} (corrupted)")
    _VERIFIED.add(os.path.realpath(folder))


def _candidates(root: str) -> list[str]:
    """Finished checkpoint folders, the one ``latest`` names first, then newest first."""
    found = sorted(
        (
            d
            for d in os.listdir(root)
            if d.startswith("step_") and not d.endswith(".tmp") and os.path.isdir(os.path.join(root, d))
        ),
        reverse=True,
    )
    named = _latest_pointer(root)
    if named in found:
        found.remove(named)
        found.insert(0, named)
    return [os.path.join(root, d) for d in found]


def _latest_pointer(root: str) -> str | None:
    pointer = os.path.join(root, "latest")
    if not os.path.lexists(pointer):
        return None
    try:
        with open(pointer) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        return f"<unreadable: {type(e).__name__}>"


def _newest_intact(root: str) -> str | None:
    candidates = _candidates(root) if os.path.isdir(root) else []
    named = _latest_pointer(root) if candidates else None
    if named is not None and os.path.join(root, named) != candidates[0]:
        log.warning(
            "%s/latest names %s, which is not there: using the newest checkpoint found instead, %s",
            root,
            named,
            os.path.basename(candidates[0]),
        )
    problems = []
    for folder in candidates:
        try:
            if os.path.realpath(folder) not in _VERIFIED:  # a resume checks first, then finds it again
                verify_checkpoint(folder)
        except CheckpointError as e:
            log.warning("checkpoint %s is not usable: %s", os.path.basename(folder), e)
            problems.append(str(e))
            continue
        if problems:
            log.warning(
                "resuming from %s, the newest intact checkpoint, instead of %s", folder, os.path.basename(candidates[0])
            )
        return folder
    if problems:
        raise CheckpointError(
            f"no intact checkpoint in {root}: {problems[0]}"
            + (f" (and {len(problems) - 1} older one(s) unusable)" if len(problems) > 1 else "")
        )
    return None


def latest_checkpoint(root: str) -> str | None:
    """The newest checkpoint of ``root`` that matches its manifest (see the module docstring);
    None when there is none at all. Collective when torch.distributed is up: rank 0 reads the
    files and every rank gets its verdict."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _newest_intact(root)
    verdict: list = [None]
    if dist.get_rank() == 0:
        try:
            verdict[0] = ("ok", _newest_intact(root))
        except CheckpointError as e:
            verdict[0] = ("error", str(e))
    dist.broadcast_object_list(verdict, src=0)
    kind, value = verdict[0]
    if kind == "error":
        raise CheckpointError(value)
    if value is not None:
        _VERIFIED.add(os.path.realpath(value))
    return value


def main(argv: list[str]) -> int:
    """``verify FOLDER|ROOT`` or ``seal FOLDER`` (write a manifest for a checkpoint you trust)."""
    if len(argv) != 2 or argv[0] not in ("verify", "seal"):
        print("usage: python -m nemo_orchestra.train.checkpoint verify FOLDER|ROOT | seal FOLDER", file=sys.stderr)
        return 2
    command, path = argv
    try:
        if command == "seal":
            print(f"wrote {write_manifest(path)}")
        elif os.path.isfile(os.path.join(path, MANIFEST)) or not os.path.isfile(os.path.join(path, "latest")):
            verify_checkpoint(path)
            print(f"{path}: intact")
        else:
            print(f"{path}: newest intact checkpoint {_newest_intact(path)}")
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
