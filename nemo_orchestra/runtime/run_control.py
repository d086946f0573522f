"""What keeps a run's work when its job ends early: the folder lock, stop signals, the record
cut-back on resume, the save schedule and the requeue decision.

- ``RunLock``: ``run.output_dir/run.lock`` is held (``flock``) for the run's life and names the
  holder's host and pid. A second launch on the folder stops at once, naming the holder; a lock
  left by a process that is gone is taken over, and the log says so.
- ``StopSignals``: SIGTERM, SIGINT and ``run.preempt_signal`` (Slurm's ``--signal=B:USR1@N``)
  ask the GRPO loop to stop after the step in flight, checkpoint and exit; a second signal drops
  the step in flight. Outside the GRPO loop (build, warm start) a signal stops the run at once.
  A file named by ``NEMO_ORCHESTRA_STOP_FILE`` (the sbatch template's trap writes it on the
  shared filesystem, reaching every rank of every node) asks the same as the preempt signal.
- ``SaveSchedule``: a checkpoint every ``checkpoint.save_every`` steps, every
  ``checkpoint.save_every_s`` seconds, at the last step and when stopping; ranks agree on it.
- ``cut_records``: ``metrics.jsonl`` and ``samples.jsonl`` keep only the steps up to the one the
  run resumes from, so each step is recorded once.
- Requeue: a run stopped by the preempt signal exits with ``REQUEUE_EXIT`` (75) while
  ``run.max_restarts`` allows, and touches ``NEMO_ORCHESTRA_REQUEUE_FILE`` when that is set;
  ``recipes/slurm/grpo_orchestrator.sbatch`` then runs ``scontrol requeue``,
  ``scripts/requeue_local.py`` relaunches the command. The restart count comes from
  ``SLURM_RESTART_COUNT`` or ``NEMO_ORCHESTRA_RESTARTS``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
RECORDS = ("metrics.jsonl", "samples.jsonl")
REQUEUE_EXIT = 75  # EX_TEMPFAIL: stopped before its time limit, resumable: run me again
STOP_FILE_ENV = "NEMO_ORCHESTRA_STOP_FILE"
REQUEUE_FILE_ENV = "NEMO_ORCHESTRA_REQUEUE_FILE"
RESTARTS_ENV = "NEMO_ORCHESTRA_RESTARTS"
SIGNALS = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2, "HUP": signal.SIGHUP, "URG": signal.SIGURG}


class RunLocked(RuntimeError):
    """Another live process holds the run folder."""


# ---- one run per folder ---------------------------------------------------------------------------


class RunLock:
    """An exclusive ``flock`` on ``folder/run.lock``, holding ``{"host", "pid", "since"}``."""

    def __init__(self, folder: str, wait_s: float = 15.0):
        self.path = os.path.join(folder, LOCK_FILE)
        self.wait_s = wait_s
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._lock(fd)
        except BaseException:
            os.close(fd)
            raise
        previous = _read_holder(fd)
        if previous and previous != self.holder():
            log.warning(
                "run folder %s: took over the lock of %s, which is gone",
                os.path.dirname(self.path),
                _describe(previous),
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(self.holder()) + "\n").encode(), 0)
        self._fd = fd
        return self

    def _lock(self, fd: int) -> None:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                holder = _read_holder(fd)
                # the holder's pid is gone but its children still hold the file: they are being ended
                if holder and _dead_here(holder) and time.monotonic() < deadline:
                    time.sleep(0.25)
                    continue
                raise RunLocked(
                    f"run.output_dir {os.path.dirname(self.path)} is in use by {_describe(holder)} "
                    f"(lock file {self.path}); stop that run or choose another run.output_dir"
                ) from None
            except OSError as e:  # a filesystem without flock: the holder's pid decides
                holder = _read_holder(fd)
                if holder and not _dead_here(holder) and holder != self.holder():
                    raise RunLocked(
                        f"run.output_dir {os.path.dirname(self.path)} is in use by {_describe(holder)} "
                        f"(lock file {self.path}, flock unavailable: {e.strerror})"
                    ) from None
                return

    @staticmethod
    def holder() -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid()}

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        os.close(self._fd)  # releases the flock
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        return {"host": str(data["host"]), "pid": int(data["pid"])} if data else None
    except (ValueError, KeyError, TypeError):
        return None


def _describe(holder: dict | None) -> str:
    return f"pid {holder['pid']} on {holder['host']}" if holder else "another process"


def _dead_here(holder: dict) -> bool:
    """The holder ran on this host and its pid is gone (a pid on another host cannot be checked)."""
    if holder["host"] != socket.gethostname():
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


# ---- stop signals -----------------------------------------------------------------------------------


REDELIVER_S = 0.05  # a signal that came inside a finalizer is sent again after this


def in_finalizer(frame) -> bool:
    """``frame`` (where a signal interrupted the main thread) runs inside a ``__del__`` or a weakref
    finalizer, which would swallow an exception raised there."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (
            code.co_name in ("__call__", "_exitfunc") and os.path.basename(code.co_filename) == "weakref.py"
        ):
            return True
        frame = frame.f_back
    return False


class StopNow(BaseException):
    """Raised by a signal handler: unwind now (outside the GRPO loop, or a second signal in it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def preempt_signal(name: str | None) -> int | None:
    if not name:
        return None
    if name.upper().removeprefix("SIG") not in SIGNALS:
        raise ValueError(f"run.preempt_signal: must be null or one of {sorted(SIGNALS)}, got {name!r}")
    return SIGNALS[name.upper().removeprefix("SIG")]


@dataclass
class StopSignals:
    """Turns SIGTERM, SIGINT and the preempt signal into a stop request (see the module docstring)."""

    preempt: int | None = None
    stop_file: str | None = field(default_factory=lambda: os.environ.get(STOP_FILE_ENV) or None)
    signum: int | None = None  # the first stop signal received
    in_loop: bool = False  # inside the GRPO loop: finish the step in flight first

    def install(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT, self.preempt):
            if sig is not None:
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if self.in_loop and first:
            log.warning(
                "%s received: finishing the step in flight, then a checkpoint (a second signal drops the step)",
                signal_name(signum),
            )
            return
        if in_finalizer(frame):
            # Python would print the StopNow as "Exception ignored in ..." and go on: deliver it again
            # in a moment, when the interrupted finalizer has returned
            threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum)).start()
            return
        self.in_loop = False
        raise StopNow(self.signum)

    def ended(self, code: int) -> None:
        """The run is over (exit ``code``): a stop signal from now on, while the interpreter exits, has
        nothing left to stop and gets one line, not a traceback from wherever the exit happens to be."""

        def late(signum, frame) -> None:
            try:
                log.warning(
                    "%s received after the run ended (exit code %d): nothing to stop", signal_name(signum), code
                )
            except Exception:  # logging already shut down
                pass

        for sig in (signal.SIGTERM, signal.SIGINT, self.preempt):
            if sig is not None:
                signal.signal(sig, late)

    def requested(self) -> bool:
        if self.signum is None and self.stop_file and os.path.exists(self.stop_file):
            log.warning("stop requested by %s: checkpoint, then exit", self.stop_file)
            self.signum = self.preempt or signal.SIGTERM
        return self.signum is not None

    @property
    def preempted(self) -> bool:
        return self.signum is not None and self.signum == self.preempt


def restart_count() -> int:
    for key in ("SLURM_RESTART_COUNT", RESTARTS_ENV):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def request_requeue(max_restarts: int) -> bool:
    """After a preempt stop: whether to be run again (``run.max_restarts`` not reached); touches
    ``NEMO_ORCHESTRA_REQUEUE_FILE`` for a launcher that cannot see the exit code (torchrun)."""
    done = restart_count()
    if done >= max_restarts:
        log.warning("not requeued: %d restart(s) done, run.max_restarts=%d", done, max_restarts)
        return False
    path = os.environ.get(REQUEUE_FILE_ENV)
    if path:
        with open(path, "w") as f:
            f.write(f"{done + 1}\n")
    return True


# ---- the save schedule -----------------------------------------------------------------------------


@dataclass
class SaveSchedule:
    every: int  # checkpoint.save_every (0: none by step count)
    every_s: float  # checkpoint.save_every_s (0: none by time)
    max_steps: int
    last_saved: int = 0
    saved_at: float = field(default_factory=lambda: time.monotonic())

    def by_step(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    def by_time(self) -> bool:
        return bool(self.every_s) and time.monotonic() - self.saved_at >= self.every_s

    def saved(self, step: int) -> None:
        self.last_saved, self.saved_at = step, time.monotonic()


def agree(flags: list[bool], device=None) -> list[bool]:
    """Each flag true on any rank is true on every rank (one all-reduce; a no-op on one process)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(flags)
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def param_versions(module) -> int:
    """A number that changes whenever a parameter is modified in place (an optimizer step)."""
    return sum(p._version for p in module.parameters())


# ---- records -----------------------------------------------------------------------------------------


def cut_records(output_dir: str, step: int) -> dict[str, int]:
    """Drop the lines of ``metrics.jsonl`` / ``samples.jsonl`` whose step is after ``step`` (in
    place: a logger holding the file open in append mode keeps writing at the new end). A torn
    last line (a kill mid-write) goes too. Returns the number of lines removed per file."""
    removed = {}
    for name in RECORDS:
        path = os.path.join(output_dir, name)
        if not os.path.isfile(path):
            continue
        keep_bytes, dropped = 0, 0
        with open(path, "rb") as f:
            for line in f:
                if _step_of(line) is not None and _step_of(line) <= step and dropped == 0:
                    keep_bytes += len(line)
                else:
                    dropped += 1
        if dropped:
            os.truncate(path, keep_bytes)
            removed[name] = dropped
    return removed


def _step_of(line: bytes) -> int | None:
    if not line.endswith(b"\n"):
        return None
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


# ---- inputs, checked before anything expensive starts --------------------------------------------


def check_task_files(cfg, dp_size: int = 1) -> int | None:
    """``data.train_path`` / ``data.eval_path``: readable, JSON lines, every record complete (the error
    names the file and line), and enough training tasks for one step (``check_enough_tasks``). Raises
    ValueError. Returns the number of training records (None: the embedded task set)."""
    from tools_env.task import load_jsonl

    n_train = None
    for key, path in (("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)):
        if not path:
            continue
        if not os.path.isfile(path):
            raise ValueError(f"{key}: no such file {path}")
        try:
            tasks = load_jsonl(path)
        except UnicodeDecodeError as e:
            raise ValueError(f"{key}: {path} is not a text file ({e.reason})") from None
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        if not tasks:
            raise ValueError(f"{key}: {path} holds no task records")
        if key == "data.train_path":
            n_train = len(tasks)
            check_enough_tasks(cfg, n_train, dp_size)
    return n_train


def check_enough_tasks(cfg, n_train: int | None, dp_size: int) -> None:
    """At least one step's prompts for every data-parallel rank in ``data.train_path`` (``n_train``
    records; None: the embedded set, sized by ``data.num_train_tasks``). Raises ValueError."""
    need = cfg.data.prompts_per_step * dp_size
    if n_train is not None and n_train < need:
        raise ValueError(
            f"data.train_path: {cfg.data.train_path} holds {n_train} task(s), fewer than one step's "
            f"data.prompts_per_step={cfg.data.prompts_per_step} x {dp_size} data-parallel rank(s)"
        )


# ---- the start and the end of a run -----------------------------------------------------------------


def start_afresh(output_dir: str, ckpt_root: str) -> None:
    """``run.resume=false``: remove the folder's checkpoints and records, saying what is removed."""
    from nemo_orchestra.train.checkpoint import remove_checkpoints

    removed = remove_checkpoints(ckpt_root)
    for name in RECORDS:
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            os.truncate(path, 0)
            removed.append(name)
    if removed:
        log.warning("run.resume=false: starting afresh in %s; removed %s", output_dir, ", ".join(removed))


def report_cut(output_dir: str, step: int) -> None:
    for name, n in cut_records(output_dir, step).items():
        log.warning(
            "%s: removed %d line(s) after step %d, written past the checkpoint this run %s",
            name,
            n,
            step,
            "resumes from" if step else "starts without (none was saved)",
        )


def resume_command() -> str:
    """The run's own command line, without a ``run.resume=`` override: ``run.resume=false`` (a fresh start, as
    ``scripts/seed_sweep.py`` passes) would remove the checkpoint the line names; the default resumes."""
    import shlex
    import sys

    argv = getattr(sys, "orig_argv", sys.argv)
    return shlex.join([a for a in argv if not a.lstrip("+").startswith("run.resume=")])


def checkpoint_named(ckpt_root: str) -> str:
    try:
        with open(os.path.join(ckpt_root, "latest")) as f:
            return os.path.join(ckpt_root, f.read().strip())
    except OSError:
        return "none"


def stop_line(signum: int, step: int, ckpt_root: str, in_flight: bool) -> str:
    where = f"during step {step + 1} (dropped)" if in_flight else f"after step {step}"
    return (
        f"stopped by {signal_name(signum)} {where}: checkpoint {checkpoint_named(ckpt_root)}; "
        f"resume with: {resume_command()}"
    )


def stopped(stop: StopSignals, step: int, ckpt_root: str, max_restarts: int) -> int:
    """The line and exit code of a run stopped after a step (its checkpoint written)."""
    log.warning("%s", stop_line(stop.signum, step, ckpt_root, in_flight=False))
    return stop_code(stop.signum, stop.preempted, max_restarts)


def stop_code(signum: int, preempted: bool, max_restarts: int) -> int:
    """REQUEUE_EXIT for the preempt signal while restarts are left (the relaunch resumes from the
    last checkpoint, or starts afresh without one), else 128 + the signal."""
    if preempted and request_requeue(max_restarts):
        log.warning("asking to be requeued (restart %d of run.max_restarts=%d)", restart_count() + 1, max_restarts)
        return REQUEUE_EXIT
    return 128 + signum


def private_run_folder(output_dir: str) -> None:
    """The run folder and all the process writes from now on are its user's alone: umask 0o077
    (folders 0700, files 0600: task copies, held-out tasks, samples, metrics, checkpoints), and
    the folder itself 0700 whether it is new or an earlier run's (which hides the 0644 files an
    older version left in it). Model-written code and other users then cannot read answers there."""
    os.umask(0o077)
    os.makedirs(output_dir, mode=0o700, exist_ok=True)
    os.chmod(output_dir, 0o700)


def guarded(run, output_dir: str, stop: StopSignals | None = None, max_restarts: int = 0) -> int:
    """``run()`` in a private run folder (``private_run_folder``), holding the folder lock (on
    rank 0); however it ends, one line and an exit code:
    1 a full disk or an error (its traceback in ``output_dir/traceback.txt``), 2 the folder in use
    or no intact checkpoint; a signal outside a GRPO step (the warm start, the evaluation, the
    export): REQUEUE_EXIT for ``stop``'s preempt signal while ``max_restarts`` allows, else 128+N."""
    import traceback
    from contextlib import nullcontext

    from nemo_orchestra.train.checkpoint import CheckpointError, CheckpointSpaceError, NonFiniteCheckpoint
    from nemo_orchestra.train.divergence import TrainingDiverged

    private_run_folder(output_dir)
    try:
        with RunLock(output_dir) if int(os.environ.get("RANK", 0)) == 0 else nullcontext():
            return run()
    except TrainingDiverged as e:  # the last finite checkpoint stays the newest
        log.error("error: %s", e)
        return 1
    except (RunLocked, CheckpointError, CheckpointSpaceError) as e:
        log.error("%s", e)
        return 1 if isinstance(e, (CheckpointSpaceError, NonFiniteCheckpoint)) else 2
    except StopNow as e:
        log.warning(
            "stopped by %s outside a GRPO step; last checkpoint %s; resume with: %s",
            signal_name(e.signum),
            checkpoint_named(os.path.join(output_dir, "checkpoints")),
            resume_command(),
        )
        return stop_code(e.signum, stop is not None and e.signum == stop.preempt, max_restarts)
    except Exception as e:
        path = os.path.join(output_dir, "traceback.txt")
        with open(path, "w") as f:
            traceback.print_exc(file=f)
        log.error("stopped by an error: %s: %s (traceback in %s)", type(e).__name__, e, path)
        return 1


def check_resume(cfg, ckpt_root: str) -> str | None:
    """``run.resume``: the model the newest intact checkpoint was trained with (its recorded config)
    against the requested one, before anything of the run is written or built. A difference in
    architecture or vocabulary is refused naming the keys. Returns the checkpoint the run resumes
    from (None: it starts afresh). A damaged checkpoint is left to the resume itself, which says
    which and falls back to an older one."""
    if not cfg.run.resume:
        return None
    from nemo_orchestra.megatron import dist_ckpt
    from nemo_orchestra.megatron.model import architecture_differences
    from nemo_orchestra.train.checkpoint import CheckpointError, latest_checkpoint

    try:
        folder = latest_checkpoint(ckpt_root)
    except CheckpointError:
        return None
    if folder is None or not os.path.isfile(os.path.join(folder, dist_ckpt.META)):
        return folder
    meta = dist_ckpt.read_meta(folder)
    diff = architecture_differences(meta.get("model", {}), cfg.model)
    if cfg.model.vocab_size is not None and meta.get("vocab_size") not in (None, cfg.model.vocab_size):
        diff.append(f"model.vocab_size={cfg.model.vocab_size} (checkpoint: {meta['vocab_size']})")
    if diff:
        raise ValueError(
            f"run.resume: {folder} was trained with another model: {', '.join(diff)}. Resume with the "
            "checkpoint's values, or start afresh: run.resume=false (removes this run's checkpoints) or "
            "another run.output_dir"
        )
    return folder
