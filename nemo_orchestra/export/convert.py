"""Hugging Face folder <-> nemo-orchestra checkpoint (Megatron's distributed format).

Import: every rank builds its TP/PP shard of the model without initializing it, reads only the
HF tensors of its pipeline stage (one at a time, through ``safetensors``), slices its TP part,
and all ranks write one distributed checkpoint. Tensors are stored by global name and offset,
so the result loads under any layout (``model.init_from=DIR``); tokenizer files are copied in.

Export: the model is built under the current layout, the checkpoint's weights are loaded
(resharded by Megatron), gathered to full tensors and written as a HF folder by rank 0.
Both write to ``DIR.tmp`` and rename, so an interrupted run leaves no half-written folder.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil

import torch
import torch.distributed as dist

from nemo_orchestra.config import ModelConfig, ParallelConfig
from nemo_orchestra.export.qwen3 import (
    HFWeights,
    hf_to_megatron_tensor,
    megatron_names,
    model_config_from_hf,
    read_hf_config,
)

log = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def import_hf(
    hf_dir: str,
    out_dir: str,
    base: ModelConfig,
    parallel: ParallelConfig,
    device: torch.device,
    dtype: str | None = None,
) -> ModelConfig:
    """Write ``out_dir`` from the HF folder; returns the model config it holds. Collective."""
    from nemo_orchestra.megatron import dist_ckpt
    from nemo_orchestra.megatron.model import build_gpt_model
    from nemo_orchestra.megatron.sharding import load_full_state

    hf_cfg = read_hf_config(hf_dir)
    dtype = dtype or DTYPES.get(str(hf_cfg.get("torch_dtype") or hf_cfg.get("dtype") or "float32"), "fp32")
    model = dataclasses.replace(model_config_from_hf(hf_cfg, base), params_dtype=dtype, init_from=None)
    vocab = model.vocab_size
    if vocab % parallel.tp or model.num_query_groups % parallel.tp or model.num_layers % parallel.pp:
        raise ValueError(
            f"parallel.tp={parallel.tp} must divide the vocabulary ({vocab}) and the KV heads "
            f"({model.num_query_groups}); parallel.pp={parallel.pp} the layers ({model.num_layers})"
        )
    gpt = build_gpt_model(model, parallel, vocab, device, initialize=False)
    weights = HFWeights(hf_dir)
    torch_dtype = gpt.config.params_dtype
    load_full_state(
        gpt, lambda n: hf_to_megatron_tensor(n, weights.__getitem__, model).to(torch_dtype), megatron_names(model)
    )
    tmp = out_dir.rstrip("/") + ".tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dist_ckpt.save(tmp, gpt=gpt, common={"source": os.path.abspath(hf_dir)})
    _barrier()
    if _rank() == 0:
        dist_ckpt.write_meta(tmp, model, vocab, source=os.path.abspath(hf_dir))
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(hf_dir, name)):
                shutil.copy2(os.path.join(hf_dir, name), tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    _barrier()
    return model


def find_tokenizer(ckpt_dir: str, explicit: str | None) -> str | None:
    """The tokenizer for an export: given, in the checkpoint, or the training run's ``tokenizer/``."""
    run_tokenizer = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt_dir))), "tokenizer")
    for folder in (explicit, ckpt_dir, run_tokenizer):
        if folder and glob.glob(os.path.join(folder, "tokenizer*.json")):
            return folder
    return None


def run_sampling(ckpt_dir: str) -> tuple[float, float]:
    """The temperature and top-p the training run sampled its rollouts with (its ``config.yaml``, beside
    ``checkpoints/``); (1.0, 1.0), the full distribution, for a checkpoint outside a run folder."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt_dir))), "config.yaml")
    if not os.path.exists(path):
        log.info(
            "%s has no run config.yaml beside its checkpoints/: generation_config.json gets temperature 1, top-p 1",
            ckpt_dir,
        )
        return 1.0, 1.0
    import yaml

    with open(path) as f:
        rollout = (yaml.safe_load(f) or {}).get("rollout") or {}
    return float(rollout.get("temperature", 1.0)), float(rollout.get("top_p", 1.0))


def export_checkpoint(
    ckpt_dir: str,
    out_dir: str,
    parallel: ParallelConfig,
    device: torch.device,
    tokenizer_dir: str | None = None,
    dtype: str | None = None,
    fmt: str = "hf",
    tp_out: int = 1,
) -> str:
    """Write a HF folder (``fmt="hf"``) or a TensorRT-LLM checkpoint sharded ``tp_out`` ways
    (``fmt="trtllm"``) from a checkpoint saved under any layout. Collective; rank 0 writes."""
    from transformers import AutoTokenizer

    from nemo_orchestra.export.hf_folder import export_hf
    from nemo_orchestra.megatron import dist_ckpt
    from nemo_orchestra.megatron.model import DTYPES as TORCH_DTYPES
    from nemo_orchestra.megatron.model import build_gpt_model
    from nemo_orchestra.megatron.sharding import gather_full_state

    if not dist_ckpt.is_checkpoint(ckpt_dir):
        raise ValueError(f"checkpoint={ckpt_dir}: not a nemo-orchestra checkpoint (no {dist_ckpt.META})")
    meta = dist_ckpt.read_meta(ckpt_dir)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in meta["model"].items() if k in fields})
    model = dataclasses.replace(model, init_from=None, fp8=None)
    if fmt == "trtllm":
        from nemo_orchestra.export.trtllm import check_tp

        check_tp(model, tp_out)  # before the weights are read
    gpt = build_gpt_model(model, parallel, meta["vocab_size"], device, initialize=False)
    dist_ckpt.load_model(gpt, ckpt_dir)
    weights = gather_full_state(gpt)
    if _rank() == 0 and fmt == "trtllm":
        from nemo_orchestra.export.trtllm import export_trtllm

        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        export_trtllm(weights, model, meta["vocab_size"], tmp, tp_out, TORCH_DTYPES[dtype or model.params_dtype])
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    elif _rank() == 0:
        tok_dir = find_tokenizer(ckpt_dir, tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True) if tok_dir else None
        if tokenizer is None:
            log.warning("no tokenizer found for %s (pass tokenizer=DIR): the export has no tokenizer files", ckpt_dir)
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        export_hf(
            weights,
            model,
            meta["vocab_size"],
            tokenizer,
            tmp,
            dtype=TORCH_DTYPES[dtype or model.params_dtype],
            sampling=run_sampling(ckpt_dir),
        )
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    _barrier()
    return out_dir
