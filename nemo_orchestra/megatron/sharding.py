"""Tensor/pipeline-parallel layout of the GPTModel weights: shard a full state dict, gather it back.

*Full* = the TP=1, PP=1 state dict under Megatron's local-spec names with global layer numbers
(what ``hf/qwen3.py`` maps to and from Hugging Face). *Local* = one rank's GPTModel state dict:
its pipeline stage's layers numbered from 0, and its tensor-parallel slice of each weight.

| weight                                  | tensor-parallel layout                                        |
| --------------------------------------- | ------------------------------------------------------------- |
| embedding.word_embeddings, output_layer | vocab-parallel: rows split (vocabulary padded to a TP multiple) |
| linear_qkv                              | column-parallel: rows, grouped per KV group, so whole groups  |
| linear_fc1                              | column-parallel over [gate; up]: rank r holds [gate_r; up_r]  |
| linear_proj, linear_fc2                 | row-parallel: columns split                                   |
| input/pre_mlp/final/q/k layernorm       | replicated                                                    |

Pipeline stages hold disjoint, contiguous blocks of layers (``num_layers / pp`` each); the first
stage holds the embedding, the last the final norm and the output layer. With tied embeddings and
PP > 1 the last stage keeps its own copy of the embedding as ``output_layer.weight``.

TransformerEngine's layer spec fuses the two pre-norms into the following linear
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); names are translated to
the local-spec ones here, so the rest of the code sees one naming.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_TE_NAMES = {  # TE spec name -> local spec name
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LOCAL_TO_TE = {v: k for k, v in _TE_NAMES.items()}


def tp_dim(name: str) -> int | None:
    """The dimension a weight is split along over tensor-parallel ranks (None: replicated)."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_fc1.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def shard_tensor(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    dim = tp_dim(name)
    if dim is None or size == 1:
        return full
    if full.shape[dim] % size:
        raise ValueError(f"{name}: dimension {dim} of shape {tuple(full.shape)} is not divisible by tp={size}")
    if name.endswith("linear_fc1.weight"):  # [gate; up] -> [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]]).contiguous()
    return full.chunk(size, dim=dim)[rank].contiguous()


def unshard_tensor(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    dim = tp_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global layer numbers held by pipeline stage ``pp_rank``."""
    if num_layers % pp:
        raise ValueError(f"model.num_layers={num_layers} must be divisible by parallel.pp={pp}")
    n = num_layers // pp
    return range(pp_rank * n, (pp_rank + 1) * n)


def full_names_of_stage(full_names, num_layers: int, pp: int, pp_rank: int, tied: bool) -> dict[str, str]:
    """{local name: full name} for the weights of one pipeline stage."""
    layers = stage_layers(num_layers, pp, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp - 1
    out = {}
    for name in full_names:
        m = _LAYER.match(name)
        if m:
            i = int(m.group(1))
            if i in layers:
                out[f"decoder.layers.{i - layers.start}.{m.group(2)}"] = name
        elif name.startswith("embedding."):
            if first:
                out[name] = name
            if last and not first and tied:
                out["output_layer.weight"] = name
        elif last:  # final_layernorm, output_layer
            out[name] = name
    return out


def local_state_dict(
    full_get, full_names, num_layers: int, tp_rank: int, tp: int, pp_rank: int, pp: int, tied: bool
) -> dict[str, torch.Tensor]:
    """This rank's shard of a full state dict. ``full_get(name)`` returns a full tensor (lazily)."""
    return {
        local: shard_tensor(full, full_get(full), tp_rank, tp)
        for local, full in full_names_of_stage(full_names, num_layers, pp, pp_rank, tied).items()
    }


def canonical_name(name: str) -> str:
    """A module's parameter name under the local spec (TE's fused-norm names translated)."""
    m = _LAYER.match(name)
    if m and m.group(2) in _TE_NAMES:
        return f"decoder.layers.{m.group(1)}.{_TE_NAMES[m.group(2)]}"
    return name


def model_state(gpt) -> dict[str, torch.Tensor]:
    """The module's weights under local-spec names, without TE/Megatron extra state."""
    return {canonical_name(k): v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}


def load_local_state(gpt, local: dict[str, torch.Tensor]) -> None:
    """Copy local-spec-named tensors into the module (TE names translated), in place, strictly."""
    targets = {
        canonical_name(k): v for k, v in gpt.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")
    }
    missing, unexpected = sorted(set(targets) - set(local)), sorted(set(local) - set(targets))
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for k, t in targets.items():
            if t.shape != local[k].shape:
                raise ValueError(f"{k}: checkpoint shape {tuple(local[k].shape)} != model shape {tuple(t.shape)}")
            t.copy_(local[k])


def load_full_state(gpt, full_get, full_names) -> None:
    """Load this rank's shard of a full state dict into one pipeline stage of the model."""
    from megatron.core import parallel_state as ps

    cfg = gpt.config
    local = local_state_dict(
        full_get,
        full_names,
        cfg.num_layers,
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        gpt.share_embeddings_and_output_weights,
    )
    load_local_state(gpt, local)


def gather_full_state(gpt) -> dict[str, torch.Tensor]:
    """Every weight of the model, full and globally numbered, on every rank of its model-parallel group.

    Collective over the tensor- and pipeline-parallel groups (each rank of them must call it).
    Tensors that needed no communication are the live weights themselves (clone to keep them).
    """
    return gather_full(model_state(gpt), gpt.config.num_layers, gpt.share_embeddings_and_output_weights, _device(gpt))


@torch.no_grad()
def gather_full(
    local: dict[str, torch.Tensor], num_layers: int, tied: bool, device: torch.device
) -> dict[str, torch.Tensor]:
    """Full tensors from this rank's local-spec-named shards (weights, or gradients laid out alike)."""
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    local = dict(local)
    if tp > 1:
        group = ps.get_tensor_model_parallel_group()
        for name in sorted(local):
            if tp_dim(name) is None:
                continue
            t = local[name].contiguous()
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t, group=group)
            local[name] = unshard_tensor(name, shards)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    offset = stage_layers(num_layers, pp, pp_rank).start
    full = {}
    for name, t in local.items():
        m = _LAYER.match(name)
        if m:
            name = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"
        elif name == "output_layer.weight" and tied:
            continue  # the last stage's copy of the embedding
        full[name] = t.detach()
    if pp == 1:
        return full
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    metas = [None] * pp
    dist.all_gather_object(metas, sorted((k, tuple(v.shape), v.dtype) for k, v in full.items()), group=group)
    out = {}
    for stage, meta in enumerate(metas):
        for name, shape, dtype in meta:
            t = full[name].contiguous() if stage == pp_rank else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=ranks[stage], group=group)
            out[name] = t
    return out


def _device(gpt) -> torch.device:
    return next(gpt.parameters()).device
