"""The console of a run: rank-0 logging above the progress bars, and the known third-party notices
that say nothing about the run filtered where they start.

``setup_logging(level, rank)`` is called by every recipe before it imports Megatron-Core or vLLM
(some of these warnings fire at import). At ``run.log_level=DEBUG`` nothing is filtered.

What is filtered, and why each is harmless:

- Megatron-Core, at import and when a model is built: "Transformer Engine and Apex are not
  installed. Falling back to ..." / "Apex is not installed. Falling back to Torch Norm"
  (UserWarning). Neither installs on a CPU machine; the torch fallbacks are what we use and test.
  With CUDA, asking for FP8 or TE without them is our own clear error (``megatron/model.py``).
- Megatron-Core's optimizer, when it zeroes gradients: torch's "The .grad attribute of a Tensor
  that is not a leaf Tensor is being accessed" (UserWarning). It only resets ``.grad`` to None on its
  fp32 shard views, whose ``.grad`` autograd never fills; the gradients live in Megatron's buffers.
- Megatron-Core's distributed optimizer, each step: torch.distributed's "``reduce_scatter_tensor`` /
  ``all_gather_into_tensor`` is deprecated" (FutureWarning). Megatron 0.16 calls the old names;
  they are aliases of the new ones in torch 2.13.
- vLLM's kernel dispatcher, at import: "``torch.distributed.reduce_op`` is deprecated"
  (FutureWarning), raised by vLLM looking attributes up on every module, not by a use of it.
- vLLM's own log, in its engine and worker processes (``VLLM_LOGGING_LEVEL=ERROR``, inherited):
  on the CPU build it warns at every start that Triton has no CPU backend, that eager mode disables
  torch.compile, that libtcmalloc/libiomp are not in ``LD_PRELOAD`` (performance hints), and that
  there is no EOS token id (we pass token ids and stop ids ourselves, ``skip_tokenizer_init``).
  Its errors still show.
- Python's multiprocessing resource tracker, at exit: "There appear to be N leaked shared_memory
  objects to clean up at shutdown" (UserWarning). vLLM's engine and workers talk through
  shared-memory queues; when the engine is shut down its processes are stopped before they unlink
  them, and the tracker (a process of its own) unlinks them: the message reports that clean-up.
- torch's C++ log in those processes (``TORCH_CPP_LOG_LEVEL=ERROR``, inherited): vLLM's CPU worker
  binds its memory to the NUMA node it runs on and torch notes it ("NUMA binding: Using MEMBIND
  policy") at WARNING.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# (category, message regex, module regex) in the sense of warnings.filterwarnings
KNOWN_WARNINGS = (
    (UserWarning, r"(Transformer Engine and Apex are|Apex is) not installed", r"megatron\.core\."),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor", r"megatron\.core\.optimizer\."),
    (
        FutureWarning,
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        r"torch\.distributed\.c10d_logger",
    ),
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated", r"vllm\.triton_utils\.dispatcher"),
)
# the same for the processes we start, in PYTHONWARNINGS's form: literal message prefix, exact module name
CHILD_WARNINGS = (
    (FutureWarning, "`torch.distributed.reduce_op` is deprecated", "vllm.triton_utils.dispatcher"),
    # "resource_tracker: There appear to be N leaked shared_memory objects" (no colon can be given here)
    (UserWarning, "resource_tracker", "multiprocessing.resource_tracker"),
)
CHILD_ENV = {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_CPP_LOG_LEVEL": "ERROR"}  # what the processes we start inherit
FORMAT = "%(asctime)s [rank{rank}] %(name)s: %(message)s"
QUIET_ENV = "NEMO_ORCHESTRA_QUIET_CONSOLE"  # set by setup_logging below DEBUG; the processes we start inherit it


class TqdmHandler(logging.StreamHandler):
    """Log lines printed above the progress bar (``tqdm.write``), not into it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # logging's contract: a handler never raises
            self.handleError(record)


def setup_logging(level: str, rank: int) -> None:
    """Rank 0 logs at ``level``, the other ranks at WARNING; below DEBUG the known notices are filtered."""
    name = level.upper()
    if not isinstance(logging.getLevelName(name), int):
        raise ValueError(f"run.log_level: {level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    handler = TqdmHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
    logging.basicConfig(level=name if rank == 0 else logging.WARNING, handlers=[handler], force=True)
    if name == "DEBUG":  # everything, vLLM's processes included
        os.environ.pop(QUIET_ENV, None)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG")
        return
    logging.getLogger("megatron").setLevel(logging.WARNING)  # it logs every parameter name at INFO
    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    os.environ[QUIET_ENV] = "1"
    quiet_vllm_imports()
    filter_known_warnings()


def quiet_vllm_imports() -> None:
    """vLLM configures its logger when an engine starts; what its modules log while they are imported
    comes before that (Triton's missing CPU backend, in every process). In a quiet console's process,
    and in the ones it starts (vLLM's engine and workers are spawned and import the recipe, hence this
    module, first), the ``vllm`` logger has ``VLLM_LOGGING_LEVEL`` from the start."""
    if os.environ.get(QUIET_ENV) and os.environ.get("VLLM_LOGGING_LEVEL"):
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())


def filter_known_warnings() -> None:
    """In this process, and (through ``PYTHONWARNINGS``) in the Python processes it starts."""
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    inherited = [s for s in os.environ.get("PYTHONWARNINGS", "").split(",") if s]
    ours = [f"ignore:{message}:{category.__name__}:{module}" for category, message, module in CHILD_WARNINGS]
    os.environ["PYTHONWARNINGS"] = ",".join(inherited + [w for w in ours if w not in inherited])


quiet_vllm_imports()  # a no-op unless this process was started by a quiet console
