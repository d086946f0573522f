"""Write a Hugging Face Qwen3 (or Llama) folder: config.json, generation_config.json, safetensors, tokenizer.

Weights go in shards of at most 2 GB with ``model.safetensors.index.json`` when there is more
than one (one ``model.safetensors`` otherwise), as ``transformers`` and vLLM expect.
``generation_config.json`` carries the sampling the policy was trained under (a run's
``rollout.temperature`` and ``rollout.top_p``; temperature 0: greedy): vLLM's OpenAI server takes it
as the default of a request that names none.
"""

from __future__ import annotations

import json
import os

import torch

from nemo_orchestra.config import ModelConfig
from nemo_orchestra.export.qwen3 import architecture, hf_config, megatron_to_hf

SHARD_BYTES = 2 * 1024**3


def export_hf(
    megatron_state: dict[str, torch.Tensor],
    model: ModelConfig,
    vocab_size: int,
    tokenizer,
    out_dir: str,
    dtype: torch.dtype = torch.float32,
    sampling: tuple[float, float] = (1.0, 1.0),
) -> str:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    os.makedirs(out_dir, exist_ok=True)
    hf = {k: v.to(dtype).contiguous().cpu() for k, v in megatron_to_hf(megatron_state, model).items()}
    dtype_name = str(dtype).replace("torch.", "")
    config = hf_config(model, vocab_size, tokenizer, dtype=dtype_name)
    config.architectures = [architecture(model)]
    config.save_pretrained(out_dir)
    temperature, top_p = sampling  # the run's rollout.temperature and top_p: a server's default (vLLM reads them)
    GenerationConfig(
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        **(dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)),
    ).save_pretrained(out_dir)
    shards, current, size = [], {}, 0
    for name in sorted(hf):
        nbytes = hf[name].numel() * hf[name].element_size()
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = hf[name]
        size += nbytes
    shards.append(current)
    index = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        index.update({k: fname for k in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in hf.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
