r"""The memory plan of one GPU when training and the vLLM engine share it (colocation).

A rank holds its Megatron shard of the policy and, beside it, a vLLM engine with the full model
(one engine per rank, pinned to the rank's GPU). With P_s the parameters of the largest pipeline
stage (embedding or LM head, and L/pp layers) over tp ranks, b the bytes of ``model.params_dtype``,
dp the data-parallel size, T the longest pack (max(``parallel.microbatch_tokens``,
``rollout.max_context``) tokens) and V the vocabulary:

    weights      = P_s b
    grads        = 4 P_s                            (fp32 gradient buffers: grad_reduce_in_fp32)
    optimizer    = (4 [b < 4] + 8) P_s / dp          (fp32 master copy and Adam's two moments,
                                                      sharded over dp by the distributed optimizer;
                                                      not sharded without it)
    reference    = P_s b, or 0 with ``reference.offload`` (then it lives in CPU memory)
    activations  = L A,  A = T H (10 + 24 / tp) b / 2 (Korthikanti et al. 2022, "Reducing Activation
                                                      Recomputation": a layer keeps s b h (10 + 24/t)
                                                      bytes in 16-bit with flash attention; 34 T H / tp
                                                      with sequence parallelism; the first pipeline
                                                      stage holds pp microbatches of L/pp layers, so L)
                   with ``parallel.activation_recompute``: L T H b (/ tp with sequence parallelism),
                   each layer's input, + A for the one layer recomputed at a time
    logits       = 2 T (V / tp) 4                   (fp32 logits and their gradient, last stage)
    engine       = P b_e + 2 GiB                    (the engine's full bf16/fp16 weights, and its
                                                      sampler, activations and CUDA graphs)
    kv_cache     = ``rollout.kv_cache_gb``, or what the rollout phase leaves of the budget
    reserved     = 2 GiB                            (CUDA contexts, NCCL buffers, allocator slack)

    budget       = ``rollout.gpu_memory_utilization`` x the GPU's memory
    training     = weights + grads + optimizer + reference + activations + logits + reserved
                   (+ engine + kv_cache unless ``rollout.sleep_while_training``: vLLM's sleep mode
                   moves the engine's weights to CPU memory and drops its KV cache while training)
    sync         = weights + grads + optimizer + reference + engine + gathered + reserved
                   gathered = P b + A b + bucket: the full weights every rank gathers from the TP/PP
                   shards, the q/k/v copies of the Hugging Face mapping (A: attention q/k/v
                   parameters) and one hand-over bucket; the engine's KV cache is still asleep
    rollout      = weights + grads + optimizer + reference + engine + kv_cache + reserved

The three phases must fit the budget, and the KV cache must hold at least one sequence of
``rollout.max_context`` tokens (2 L Hkv D b_e bytes a token). The figures are estimates: they
leave out fragmentation and the engine's prefix-cache policy. The plan of a recipe, on any machine:
``python -m nemo_orchestra.train.memory_plan recipe=NAME world_size=N gpu_gb=80``.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch

from nemo_orchestra.config import Config
from nemo_orchestra.rollout.engines.vllm import BUCKET_BYTES, kv_bytes_per_token

log = logging.getLogger(__name__)

GiB = 1024**3
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ENGINE_EXTRA = 2 * GiB
RESERVED = 2 * GiB


@dataclass(frozen=True)
class MemoryPlan:
    gpu_bytes: int
    budget: int
    weights: int
    grads: int
    optimizer: int
    reference: int
    activations: int
    logits: int
    engine: int
    kv_cache: int
    kv_per_token: int
    sleep: bool
    gathered: int = 0

    @property
    def resident(self) -> int:
        """What stays on the GPU in both phases: the training state."""
        return self.weights + self.grads + self.optimizer + self.reference + RESERVED

    @property
    def training(self) -> int:
        engine = 0 if self.sleep else self.engine + self.kv_cache
        return self.resident + self.activations + self.logits + engine

    @property
    def rollout(self) -> int:
        return self.resident + self.engine + self.kv_cache

    @property
    def sync(self) -> int:
        kv = 0 if self.sleep else self.kv_cache
        return self.resident + self.engine + kv + self.gathered

    def table(self) -> str:
        rows = [
            ("weights", self.weights),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("reference", self.reference),
            ("activations", self.activations),
            ("logits", self.logits),
            ("engine weights+workspace", self.engine),
            ("kv cache", self.kv_cache),
            ("reserved", RESERVED),
            ("gathered for the weight sync", self.gathered),
            ("= training phase" + (" (engine asleep)" if self.sleep else ""), self.training),
            ("= weight-sync phase", self.sync),
            ("= rollout phase", self.rollout),
            (f"budget of {self.gpu_bytes / GiB:.0f} GiB", self.budget),
        ]
        tokens = self.kv_cache // self.kv_per_token if self.kv_per_token else 0
        lines = [f"  {name:<32}{b / GiB:8.2f} GiB" for name, b in rows]
        return "memory plan per GPU:\n" + "\n".join(lines) + f"\n  kv cache holds {tokens} tokens"


def stage_params(cfg: Config, vocab: int) -> tuple[int, int]:
    """(parameters of the full model, of the largest pipeline stage's tensor-parallel shard)."""
    m, p = cfg.model, cfg.parallel
    h, d = m.hidden_size, m.head_dim
    layer = (
        h * (m.num_attention_heads + 2 * m.num_query_groups) * d
        + m.num_attention_heads * d * h
        + 3 * h * m.ffn_hidden_size
        + 2 * h
        + (2 * d if m.qk_norm else 0)
    )
    embed = vocab * h
    head = 0 if m.tie_embeddings else vocab * h
    full = embed + head + m.num_layers * layer + h
    per_stage = m.num_layers // p.pp * layer
    ends = embed + head + h if p.pp == 1 else max(embed, vocab * h + h)  # a tied head is a copy on the last stage
    return full, (per_stage + ends) // p.tp


def activation_bytes(cfg: Config, tokens: int) -> int:
    m, p = cfg.model, cfg.parallel
    b = BYTES[m.params_dtype]
    per_token_layer = 34 * m.hidden_size / p.tp if p.sequence_parallel else m.hidden_size * (10 + 24 / p.tp)
    layer = tokens * per_token_layer * b / 2
    if not p.activation_recompute:
        return int(m.num_layers * layer)
    inputs = m.num_layers * tokens * m.hidden_size * b / (p.tp if p.sequence_parallel else 1)
    return int(inputs + layer)


def plan(cfg: Config, vocab: int, world_size: int, gpu_bytes: int) -> MemoryPlan:
    """The plan of one GPU for ``cfg`` on ``world_size`` ranks of ``gpu_bytes`` each (formulas above)."""
    m, p, r = cfg.model, cfg.parallel, cfg.rollout
    b, b_e = BYTES[m.params_dtype], BYTES["fp16" if m.params_dtype == "fp32" else m.params_dtype]
    dp = max(world_size // (p.tp * p.pp), 1)
    full, shard = stage_params(cfg, vocab)
    qkv = m.num_layers * m.hidden_size * (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim
    tokens = max(p.microbatch_tokens, r.max_context)
    optimizer = (8 + (4 if b < 4 else 0)) * shard // (dp if p.distributed_optimizer else 1)
    budget = int(r.gpu_memory_utilization * gpu_bytes)
    kv_per_token = kv_bytes_per_token(m, b_e)
    partial = MemoryPlan(
        gpu_bytes,
        budget,
        weights=shard * b,
        grads=4 * shard,
        optimizer=optimizer,
        reference=0 if cfg.reference.offload else shard * b,
        activations=activation_bytes(cfg, tokens),
        logits=2 * tokens * (vocab // p.tp) * 4,
        engine=full * b_e + ENGINE_EXTRA,
        kv_cache=0,
        kv_per_token=kv_per_token,
        sleep=r.sleep_while_training,
        gathered=(full + qkv) * b + BUCKET_BYTES,
    )
    kv = int(r.kv_cache_gb * GiB) if r.kv_cache_gb is not None else max(budget - partial.rollout, 0)
    if not r.sleep_while_training and r.kv_cache_gb is None:  # the KV cache is held while training and syncing
        kv = max(min(kv, budget - partial.training, budget - partial.sync), 0)
    return MemoryPlan(**{**partial.__dict__, "kv_cache": kv})


def check(p: MemoryPlan, cfg: Config) -> None:
    """ValueError naming the keys to change when the plan does not fit its budget."""
    r = cfg.rollout
    over = f"over the budget of {p.budget / GiB:.1f} GiB (rollout.gpu_memory_utilization={r.gpu_memory_utilization})"
    if p.training > p.budget:
        raise ValueError(
            f"memory plan: the training phase needs {p.training / GiB:.1f} GiB per GPU, {over}; lower "
            "parallel.microbatch_tokens or rollout.max_context, raise parallel.tp or parallel.pp, set "
            "parallel.activation_recompute=true, parallel.sequence_parallel=true, reference.offload=true "
            "or rollout.sleep_while_training=true"
        )
    if p.sync > p.budget:
        raise ValueError(
            f"memory plan: the weight sync needs {p.sync / GiB:.1f} GiB per GPU (the gathered full "
            f"weights beside the training state and the engine), {over}; raise parallel.tp or "
            "parallel.pp, or set reference.offload=true or rollout.sleep_while_training=true"
        )
    if p.rollout > p.budget:
        raise ValueError(
            f"memory plan: the rollout phase needs {p.rollout / GiB:.1f} GiB per GPU, {over}; lower "
            f"rollout.kv_cache_gb ({r.kv_cache_gb}) or raise parallel.tp"
        )
    need = r.max_context * p.kv_per_token
    if p.kv_cache < need:
        raise ValueError(
            f"memory plan: {p.kv_cache / GiB:.2f} GiB is left for the engine's KV cache, less than one sequence "
            f"of rollout.max_context={r.max_context} tokens ({need / GiB:.2f} GiB); lower rollout.max_context, "
            "raise rollout.kv_cache_gb or rollout.gpu_memory_utilization, set rollout.sleep_while_training=true "
            "or reference.offload=true, or raise parallel.tp"
        )


def memory_check(cfg: Config, vocab: int, world_size: int, device: torch.device) -> int | None:
    """At start, for the vllm engine on CUDA: log the plan of this GPU and raise ValueError (naming
    the keys) when it does not fit; returns the engine's KV cache bytes. None elsewhere."""
    if cfg.rollout.engine != "vllm" or device.type != "cuda":
        return None
    p = plan(cfg, vocab, world_size, torch.cuda.get_device_properties(device).total_memory)
    log.info("%s", p.table())
    check(p, cfg)
    return p.kv_cache


def main(argv: list[str]) -> int:
    """Print the plan of a recipe: ``recipe=NAME world_size=N gpu_gb=G`` and any other override."""
    from nemo_orchestra.config import ConfigError, load_config

    own = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] in ("world_size", "gpu_gb")}
    try:
        cfg = load_config([a for a in argv if a.split("=", 1)[0] not in own])
        world, gpu = int(own.get("world_size", 8)), float(own.get("gpu_gb", 80))
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if cfg.model.vocab_size is None:
        print(
            "config error: model.vocab_size: the plan needs it (the embedded tokenizer sets it at run time)",
            file=sys.stderr,
        )
        return 2
    p = plan(cfg, cfg.model.vocab_size, world, int(gpu * GiB))
    print(p.table())
    try:
        check(p, cfg)
    except ValueError as e:
        print(f"does not fit: {e}", file=sys.stderr)
        return 1
    print("fits")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
