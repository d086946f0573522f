"""The CUDA stream of an in-process engine (``hf``, ``megatron``, ``megatron_copy``), ordered against the trainer's.

On one GPU the trainer queues its kernels on the device's default stream. An engine called from the engine
thread (``rollout/scheduler.py``) would queue on that stream too (a thread's current stream starts as the
default one), so with rollouts ahead generation and training would still run one after the other. Each
engine works on a stream of its own instead (``EngineStream.run``), and events order it against the
trainer's work only where they share memory:

- a weight load (``load_weights``) starts after the work the trainer queued before it (the gather that made
  the state, the optimizer step before that), and the trainer's later work waits for the load's copies (it
  frees the gathered state and updates the parameters the state may alias);
- a generate call of an engine that reads the policy's own parameters (``megatron``) is ordered the same
  way both sides: it reads what the last optimizer step wrote, and the next one must not write under it;
- a generate call of an engine with weights of its own (``hf``, ``megatron_copy``) is not ordered: it
  overlaps the trainer's work.

The stream is made with ``cudaStreamNonBlocking`` (PyTorch's pool), so it does not synchronise with the
legacy default stream either. On a CPU there is no stream: ``run`` is a plain block.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class EngineStream:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def run(self, after_trainer: bool) -> Iterator[None]:
        """The block's device work on the engine's stream (on the engine's device); with ``after_trainer``,
        after the work queued so far on the trainer's (default) stream, and the trainer's stream waits for the
        block's work before anything queued on it later."""
        if self.stream is None:
            yield
            return
        trainer = torch.cuda.default_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if after_trainer:
                self.stream.wait_stream(trainer)
            try:
                yield
            finally:
                if after_trainer:
                    trainer.wait_stream(self.stream)
