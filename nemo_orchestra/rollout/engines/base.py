"""The generation-engine interface: token ids in, token ids and their logprobs out.

Every engine (``rollout.engine``: ``vllm``, ``hf``, ``megatron``) implements ``GenerationEngine``.
The agent loop (``rollout/loop.py``) drives it through ``generate`` only; the trainer pushes its
weights with ``load_weights`` after each optimizer step, unless the engine reads the policy's own
parameters (``capabilities.reads_policy_weights``); ``close`` releases what the engine holds
(processes, files); ``sleep`` and ``wake_up`` bracket the training stage, so that an engine sharing
the GPU with the trainer gives its memory back meanwhile. An engine whose forward spans the tensor-parallel group
(``capabilities.spans_tensor_parallel_group``) is driven from the group's first rank, while the
others run its calls in ``serve()`` until the first rank calls ``release()``.

Engines are built in one place, ``rollout.engines.start_engine``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from nemo_orchestra.rollout.engine_registry import EngineCapabilities

__all__ = ["EngineCapabilities", "EngineContext", "Generation", "GenerationEngine", "check_seeds"]


@dataclass
class Generation:
    token_ids: list[int]  # generated ids, up to and including the stop token when one was produced
    logprobs: list[float]  # log p(token) under the sampling temperature, one per generated id
    finished: bool  # ended with a stop token (False: hit max_new_tokens)


@dataclass
class EngineContext:
    """What building an engine may need; each engine takes what it uses."""

    model_cfg: Any  # config.ModelConfig
    vocab_size: int
    tokenizer: Any
    device: torch.device
    rollout: Any = None  # config.RolloutConfig (context length, sync timeout)
    seed: int = 0
    model: torch.nn.Module | None = None  # the live policy module, for engines that read its parameters
    parallel: Any = None  # config.ParallelConfig: the layout of an engine that builds a model like the policy's
    kv_cache_bytes: int | None = None  # the KV cache the memory plan gives the engine (train/memory_plan.py)
    cpus: list[int] | None = None  # on a CPU, the cores the engine's worker is bound to (None: its own choice)
    live_sequences: int | None = None  # the most sequences the run keeps in the engine at once (train/build.py)


@runtime_checkable
class GenerationEngine(Protocol):
    capabilities: EngineCapabilities

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_ids: list[int],
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        """One ``Generation`` per prompt. temperature <= 0 is greedy (logprobs then under temperature
        1); a sequence ends after a token of ``stop_ids`` (kept, finished) or at ``max_new_tokens``.
        ``seeds`` (one per prompt, 0 <= seed < 2**63): a sampled sequence draws from its own seed
        alone, so its tokens do not depend on the rest of the batch (``engines/sampling.py``);
        None: the engine's own generator."""
        ...

    def load_weights(self, megatron_state: dict[str, torch.Tensor]) -> None:
        """The trainer's full (gathered) Megatron state dict, loaded in place."""
        ...

    def close(self) -> None:
        """Release processes and files; the engine is unusable afterwards."""
        return None

    def sleep(self) -> None:
        """Release accelerator memory while the trainer trains (vLLM's sleep mode on CUDA); no-op elsewhere.
        The next ``wake_up`` must be followed by ``load_weights``: a sleeping engine may drop its weights."""
        return None

    def wake_up(self) -> None:
        """Take back what ``sleep`` released, before ``load_weights`` and ``generate``."""
        return None

    def serve(self) -> None:
        """On the other ranks of the TP group: run the first rank's generate calls until ``release()``."""
        return None

    def release(self) -> None:
        """On the first rank of the TP group: end the other ranks' ``serve()``."""
        return None


def check_seeds(seeds: list[int] | None, prompts: int, engine: str) -> None:
    """``generate``'s seeds: one per prompt, each in [0, 2**63)."""
    if seeds is None:
        return
    if len(seeds) != prompts:
        raise ValueError(f"{engine} engine: {len(seeds)} seeds for {prompts} prompts (one per prompt)")
    bad = next((s for s in seeds if not isinstance(s, int) or not 0 <= s < 2**63), None)
    if bad is not None:
        raise ValueError(f"{engine} engine: seed {bad!r} is not an integer in [0, 2**63)")
