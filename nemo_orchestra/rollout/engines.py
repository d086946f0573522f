"""Generation engines by name (``rollout.engine``). An engine takes token ids and returns token ids
with their logprobs (``generate``), and takes the trainer's weights in place (``load_weights``)."""

from __future__ import annotations


def _hf(model_cfg, vocab_size, tokenizer, device):
    from nemo_orchestra.rollout.hf_engine import HFEngine

    return HFEngine(model_cfg, vocab_size, tokenizer, device)


ENGINES = {"hf": _hf}


def build_engine(name: str, model_cfg, vocab_size: int, tokenizer, device):
    if name not in ENGINES:
        raise ValueError(f"rollout.engine: unknown engine {name!r}; choose one of {sorted(ENGINES)}")
    return ENGINES[name](model_cfg, vocab_size, tokenizer, device)
