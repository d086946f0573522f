"""A vLLM general plugin (entry point ``vllm.general_plugins`` in ``pyproject.toml``): vLLM runs
``register`` in each process it starts (engine core, workers), before they talk to each other.

What it sets: how long a vLLM process busy-waits for the next message from another (vLLM's
``SpinCondition``: a reader calls ``sched_yield`` in a loop for 1 s after each message before it
blocks on a socket). On a CPU whose cores the engine shares with the trainer (rollouts ahead of
training, ``train/build.py: engine_cpus``) that loop takes cycles from the trainer whenever the
engine core waits for its worker or the worker for its next step. With
``NEMO_ORCHESTRA_VLLM_SPIN_S`` set (``vllm_memory.pinned_to`` sets 0 for such an engine) readers
block after that many seconds instead. Measured on the GRPO benchmark (2-core AVX2 EPYC, 16 x 8,
one step ahead, README "Fast GRPO"). Without the variable nothing changes: on cores of its own
vLLM's spinning pays (a decode step of 128 sequences: 49.6 ms spinning, 56.7 ms blocking).

A blocked reader also wakes every ``RECHECK_MS`` to look at the buffer itself. vLLM's wake-up can
be lost: the writer's socket keeps one notification in flight and drops the next (``SNDHWM=1``),
and on busy cores the first may still be in flight when the second is sent. vLLM's own recheck
comes after 5 s, which a spinning reader never reaches; a blocking one did, 2 calls in 60 on
busy cores (``tests/unit/test_vllm_spin.py``), and one step ahead of training about every third step.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV = "NEMO_ORCHESTRA_VLLM_SPIN_S"
RECHECK_MS = 50  # a lost wake-up costs at most this; an idle reader wakes 20 times a second


def check_spin_env() -> None:
    """In the trainer, before vLLM starts: a value set by hand must be a number of seconds >= 0 (vLLM's
    processes would only log a warning, out of sight)."""
    value = os.environ.get(ENV)
    if value is not None and _seconds(value) is None:
        raise ValueError(f"{ENV}={value!r}: must be a number of seconds >= 0 (0: vLLM's processes never spin)")


def _seconds(value: str) -> float | None:
    try:
        s = float(value)
    except ValueError:
        return None
    return s if s >= 0 else None


def register() -> None:
    value = os.environ.get(ENV)
    if value is None:
        return
    spin_s = _seconds(value)
    if spin_s is None:  # check_spin_env stops the trainer's own engines before this
        log.warning("%s=%r is not a number of seconds >= 0: vLLM's processes spin as they would", ENV, value)
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM layout: its defaults stay
        log.warning("%s: this vLLM has no SpinCondition; its processes spin as they would", ENV)
        return
    if getattr(SpinCondition, "_nemo_orchestra_spin_s", None) is not None:  # loaded twice in one process
        return
    wait = SpinCondition.wait

    def wait_spinning_at_most(self, timeout_ms=None):
        if self.is_reader:
            self.busy_loop_s = spin_s
            timeout_ms = RECHECK_MS if timeout_ms is None else min(timeout_ms, RECHECK_MS)
        return wait(self, timeout_ms)

    wait_spinning_at_most.__wrapped__ = wait
    SpinCondition.wait = wait_spinning_at_most
    SpinCondition._nemo_orchestra_spin_s = spin_s
