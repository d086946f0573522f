"""A vLLM general plugin (entry point ``vllm.general_plugins`` in ``pyproject.toml``): vLLM runs
``register`` in each process it starts (engine core, workers), before they talk to each other.

What it sets: how long a vLLM process busy-waits for the next message from another (vLLM's
``SpinCondition``: a reader calls ``sched_yield`` in a loop for 1 s after each message before it
blocks on a socket). On a CPU whose cores the engine shares with the trainer (rollouts ahead of
training, ``train/build.py: engine_cpus``) a second of that loop after each call takes the engine's
core from the trainer's threads (the reference pass runs on its idle cycles) until the next call.
With ``NEMO_ORCHESTRA_VLLM_SPIN_S`` set, readers spin that many seconds after a message, then block;
``vllm_memory.pinned_to`` sets ``PINNED_SPIN_S`` for such an engine, whose processes all run on its
own cores. Not 0: within a decode step the engine core and the worker hand over to each other twice,
a few milliseconds apart, and a reader that blocks at once loses a wake-up (below) at nearly every
step, each one waited out until a recheck; spinning a bounded 5 ms covers both hand-overs, so the
reader sees each message without a wake-up. Idle between calls, readers block after those 5 ms.
Without the variable nothing changes: on cores of its own vLLM's spinning pays, and stays as vLLM
sets it (docs/performance.md).

A blocked reader also wakes every ``RECHECK_MS`` to look at the buffer itself. vLLM's wake-up can
be lost: the writer's socket keeps one notification in flight and drops the next (``SNDHWM=1``),
and on busy cores the first may still be in flight when the second is sent. vLLM's own recheck
comes after 5 s, which a spinning reader never reaches and a blocking one on busy cores does
(``tests/integration/test_vllm_spin.py``): without the plugin's recheck such a call stalls for those 5 s.

With ``NEMO_ORCHESTRA_VLLM_FAST_TOP_P=1`` (the vllm engine sets it on CPU) vLLM's CPU sampler takes
its top-p mask from ``top_p_by_values_``: the same nucleus found from the sorted probabilities alone,
without vLLM's argsort and scatter, whose ``torch.sort`` over every row's vocabulary is a large share
of a CPU worker's decode step; NumPy's vectorized value sort is far cheaper (docs/performance.md).
Requests that also set top-k, and other devices, keep vLLM's own.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

log = logging.getLogger(__name__)

ENV = "NEMO_ORCHESTRA_VLLM_SPIN_S"
TOP_P_ENV = "NEMO_ORCHESTRA_VLLM_FAST_TOP_P"
RECHECK_MS = 50  # a lost wake-up costs at most this; an idle reader wakes 20 times a second
PINNED_SPIN_S = 0.005  # an engine on cores of its own beside the trainer: spin this long after a message


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
    if os.environ.get(TOP_P_ENV) == "1":
        _patch_top_p()
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


def top_p_by_values_(logits_BV: torch.Tensor, p_B: torch.Tensor) -> torch.Tensor:
    """Top-p (nucleus) filtering of ``logits_BV`` in place, as vLLM's sort-based mask defines it: per
    row, the smallest tokens whose cumulative probability (ascending) stays <= 1 - p are set to -inf,
    the most probable token always kept. Found without an argsort: the row's probabilities sorted by
    value alone give the cumulative sums, hence the smallest kept probability, and every token below
    it goes. Where probabilities tie at that boundary, all tied tokens stay (vLLM keeps those its
    sort put last), so the kept mass is still >= p. Returns ``logits_BV``."""
    V = logits_BV.shape[-1]
    probs_BV = logits_BV.softmax(dim=-1, dtype=torch.float32)
    sorted_BV = torch.from_numpy(np.sort(probs_BV.numpy(), axis=-1))
    cum_BV = sorted_BV.cumsum(dim=-1)
    dropped_B1 = (cum_BV <= (1.0 - p_B.to(torch.float32)).unsqueeze(1)).sum(dim=-1, keepdim=True)
    smallest_kept_B1 = sorted_BV.gather(-1, dropped_B1.clamp_(max=V - 1))
    return logits_BV.masked_fill_(probs_BV < smallest_kept_B1, float("-inf"))


def _patch_top_p() -> None:
    try:
        from vllm.v1.sample.ops import topk_topp_sampler as sampler
    except ImportError:  # another vLLM layout: its own top-p stays
        log.warning("%s: this vLLM has no topk_topp_sampler; its own top-p stays", TOP_P_ENV)
        return
    original = getattr(sampler, "apply_top_k_top_p", None)
    if original is None or getattr(original, "_nemo_orchestra", False):
        return

    def apply_top_k_top_p(logits, k, p):
        if k is None and p is not None and logits.device.type == "cpu" and logits.dim() == 2:
            return top_p_by_values_(logits, p)
        return original(logits, k, p)

    apply_top_k_top_p._nemo_orchestra = True
    apply_top_k_top_p.__wrapped__ = original
    sampler.apply_top_k_top_p = apply_top_k_top_p
