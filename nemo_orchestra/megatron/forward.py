"""Packed (THD) forwards through Megatron's pipeline schedule: logprobs, and forward/backward.

Every forward goes through ``get_forward_backward_func``: with PP = 1 it is a plain loop over
microbatches, with PP > 1 the 1F1B schedule, whose p2p shapes are fixed, so every pack of a step
must have the same length (the trainer pads them). Logprobs and entropy come from the
vocab-parallel logits (``megatron/vocab_parallel.py``) on the last stage; the forward-only pass
broadcasts its logprobs to the other stages.

Only the loss's tokens need logits: with ``loss_rows`` the output layer runs on the rows where
``loss_mask_T`` is 1 (``logits_at``), and their logprobs are scattered back to the pack's length
(0 elsewhere). In a GRPO or warm-start pack most tokens are prompt and tool observations, so this
skips most of the output layer's matmul and the vocabulary-wide softmax. The last transformer layer
needs no more rows than that either, past its key/value projection (``last_layer_at``): its queries,
attention output, MLP and final norm run on those rows only.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from nemo_orchestra.megatron.vocab_parallel import logprobs_and_entropy
from nemo_orchestra.types import PackedBatch


def packed_params(batch: PackedBatch, device):
    from nemo_orchestra.megatron.attention import SharedPromptParams

    cu = batch.cu_seqlens_B1.to(device)
    return SharedPromptParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=batch.max_seqlen,
        max_seqlen_kv=batch.max_seqlen,
        prefix_B=batch.prefix_B,
    )


def packed_forward(m, batch: PackedBatch, device, rows_N: torch.Tensor | None = None):
    """The pack's logits [1, T, V_r]; with ``rows_N`` only those positions' [1, N, V_r] (``logits_at``)."""
    with logits_at(m, rows_N), rope_at_positions(m, batch, device):
        return m(
            batch.input_ids_T[None].to(device),
            batch.position_ids_T[None].to(device),
            None,
            packed_seq_params=packed_params(batch, device),
        )


def _submodule(m, name: str):
    while not hasattr(m, name) and hasattr(m, "module"):
        m = m.module
    return getattr(m, name, None)


@contextmanager
def rope_at_positions(m, batch: PackedBatch, device):
    """Within: rotary embeddings at the pack's ``position_ids_T``, token by token, for a pack with shared
    prompts (``prefix_B``), whose continuations start at the prompt's length, not at 0. Megatron's RoPE
    otherwise restarts at each sequence of ``cu_seqlens``; given one frequency row per token of the pack
    (its length T), it applies row i to token i. Nothing changes for other packs."""
    rope = _submodule(m, "rotary_pos_emb")
    if batch.prefix_B is None or rope is None:
        yield
        return
    positions_T = batch.position_ids_T.to(device)
    length = int(batch.position_ids_T.max()) + 1

    def per_token(module, args, output):
        return module.forward(length).index_select(0, positions_T.to(output.device))

    handle = rope.register_forward_hook(per_token)
    try:
        yield
    finally:
        handle.remove()


def loss_rows(batch: PackedBatch, device, plans: bool = False) -> torch.Tensor:
    """Positions of the pack whose target is in the loss (its loss mask's; with ``plans``, its one-token plans'
    too, which the plans' restatement reads: ``train/step.py: restatement_logprobs``)."""
    rows = batch.loss_mask_T > 0
    if plans and batch.plan_rows_P is not None:
        rows = rows.clone()
        rows[batch.plan_rows_P] = True
    return torch.nonzero(rows)[:, 0].to(device)


def _output_layer(m):
    return _submodule(m, "output_layer")


@contextmanager
def logits_at(m, rows_N: torch.Tensor | None):
    """Within: the model returns the logits of ``rows_N`` only (sequence positions of a THD pack,
    batch 1, ascending). Where ``last_layer_at`` applies, the last transformer layer already keeps
    only those rows; otherwise the output layer sees only those rows' hidden states. With sequence
    parallelism its input is a sequence shard that it gathers itself, so there the rows are taken from
    its output instead (the logits are computed in full, the callers see the same shape). Nothing
    changes without rows or on a pipeline stage without the output layer."""
    layer = _output_layer(m)
    if rows_N is None or layer is None:
        yield
        return
    if rows_N.numel() and selects_last_layer_rows(m):  # a pack without loss rows (padding) runs whole
        with last_layer_at(_last_layer(m), rows_N):
            yield
        return

    def select_input(module, args, kwargs):
        return (args[0].index_select(0, rows_N), *args[1:]), kwargs

    def select_output(module, args, output):
        logits, bias = output
        return logits.index_select(0, rows_N), bias

    if getattr(layer, "sequence_parallel", False):
        handle = layer.register_forward_hook(select_output)
    else:
        handle = layer.register_forward_pre_hook(select_input, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def selects_last_layer_rows(model) -> bool:
    """Whether ``logits_at`` runs the last layer on the loss's rows (``last_layer_at``) in ``model``
    (the last pipeline stage's: other stages compute every row)."""
    chunks = model if isinstance(model, list | tuple) else [model]
    for m in chunks:
        layer = _output_layer(m)
        if layer is not None:
            return _last_layer(m) is not None and not getattr(layer, "sequence_parallel", False)
    return False


def _last_layer(m):
    """The model's last transformer layer when this stage holds it and ``last_layer_at`` can run it
    on selected rows: not with activation recomputation (the recomputed forward would run without
    the selection), an attention output gate (computed on every row) or FP8 (TransformerEngine's FP8
    GEMMs take row counts in multiples of 16 only)."""
    decoder = _submodule(m, "decoder")
    layers = getattr(decoder, "layers", None)
    if not layers:
        return None
    last = layers[-1]
    config = getattr(last, "config", None)
    attention = getattr(last, "self_attention", None)
    if (
        config is None
        or getattr(config, "recompute_granularity", None) is not None
        or getattr(config, "attention_output_gate", False)
        or getattr(config, "sequence_parallel", False)
        or getattr(config, "fp8", None)
        or not hasattr(last, "input_layernorm")
        or not hasattr(attention, "core_attention")
    ):
        return None
    return last


@contextmanager
def last_layer_at(layer, rows_N: torch.Tensor):
    """Within: ``layer`` (a Megatron ``TransformerLayer`` of a THD pack, the model's last) takes every
    row up to its key/value projection and returns ``rows_N`` only. Its input norm and QKV projection
    run on all rows (every query attends to their keys and values); its core attention computes the
    queries of ``rows_N`` (``PackedCoreAttention.rows_N``; another core attention's output is taken at
    those rows); the output projection, residuals, MLP and, after the layer, the final norm and the
    output layer see those rows only. The gradient reaches every row's input through the keys and
    values."""
    from nemo_orchestra.megatron.attention import PackedCoreAttention

    full = {}

    def select_rows(module, args, kwargs):
        if "hidden_states" in kwargs:
            full["hidden"] = kwargs["hidden_states"]
            kwargs = {**kwargs, "hidden_states": full["hidden"].index_select(0, rows_N)}
        else:
            full["hidden"] = args[0]
            args = (args[0].index_select(0, rows_N), *args[1:])
        return args, kwargs

    def norm_every_row(module, args):
        return (full["hidden"], *args[1:])

    def attention_at_rows(module, args, output):
        return output.index_select(0, rows_N)

    core = layer.self_attention.core_attention
    handles = [
        layer.register_forward_pre_hook(select_rows, with_kwargs=True),
        layer.input_layernorm.register_forward_pre_hook(norm_every_row),
    ]
    if isinstance(core, PackedCoreAttention):
        core.rows_N = rows_N
    else:
        handles.append(core.register_forward_hook(attention_at_rows))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if isinstance(core, PackedCoreAttention):
            core.rows_N = None
        full.clear()


def scatter_rows(values_N: torch.Tensor, rows_N: torch.Tensor | None, length: int) -> torch.Tensor:
    """Per-row values back at their positions in a [length] vector (0 elsewhere); differentiable."""
    if rows_N is None:
        return values_N
    return values_N.new_zeros(length).index_copy(0, rows_N, values_N)


def pack_logprobs(
    logits_1NV: torch.Tensor, batch: PackedBatch, rows_N: torch.Tensor | None, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pack's target logprobs [T], 0 off ``rows_N``; the entropy at each row [N], zeros without
    ``with_entropy``) from the logits of ``packed_forward(..., rows_N)``; differentiable."""
    targets = batch.target_ids_T.to(logits_1NV.device)
    lp, ent = logprobs_and_entropy(
        logits_1NV[0], targets if rows_N is None else targets[rows_N], temperature, with_entropy=with_entropy
    )
    return scatter_rows(lp, rows_N, batch.num_tokens), ent


def token_logprobs(logits_1TV: torch.Tensor, target_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) from (vocab-parallel) logits without gathering the vocabulary."""
    return logprobs_and_entropy(logits_1TV[0], target_T, temperature, with_entropy=False)[0]


def run_schedule(model, forward_step, batches: list[PackedBatch], forward_only: bool, collect: bool = False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    lengths = {b.num_tokens for b in batches}
    if len(lengths) > 1 and pp_size() > 1:
        raise ValueError(
            f"pipeline parallelism needs packs of one length, got {sorted(lengths)} (pack with pad_to_length)"
        )
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=model,
        num_microbatches=len(batches),
        seq_length=max(lengths),
        micro_batch_size=1,
        forward_only=forward_only,
        collect_non_loss_data=collect,
    )


@torch.no_grad()
def forward_logprobs(
    model: torch.nn.Module,
    batches: PackedBatch | list[PackedBatch],
    device,
    temperature: float = 1.0,
    only_loss_tokens: bool = False,
) -> torch.Tensor | list[torch.Tensor]:
    """Token logprobs of each pack (forward only, through the pipeline), on every stage, on the CPU;
    with ``only_loss_tokens``, computed where ``loss_mask_T`` is 1 and 0 elsewhere."""
    single = isinstance(batches, PackedBatch)
    batches = [batches] if single else list(batches)
    if not batches:
        return []
    model.eval()

    def forward_step(data_iterator, m):
        batch = next(data_iterator)
        rows = loss_rows(batch, device) if only_loss_tokens else None
        out = packed_forward(m, batch, device, rows)

        def collect(output, non_loss_data=True):
            return pack_logprobs(output, batch, rows, temperature, with_entropy=False)[0].cpu()

        return out, collect

    store = run_schedule(model, forward_step, batches, forward_only=True, collect=True)
    out = _from_last_stage(store, [b.num_tokens for b in batches])
    return out[0] if single else out


def _from_last_stage(tensors: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
    """The last pipeline stage's per-pack fp32 tensors, broadcast to every stage."""
    from megatron.core import parallel_state as ps

    if pp_size() == 1:
        return tensors
    from nemo_orchestra.megatron.parallel import comm_device

    group = ps.get_pipeline_model_parallel_group()
    src = ps.get_pipeline_model_parallel_last_rank()
    device = comm_device()
    if ps.is_pipeline_last_stage():
        flat = torch.cat(tensors).to(device)
    else:
        flat = torch.empty(sum(lengths), dtype=torch.float32, device=device)
    dist.broadcast(flat, src=src, group=group)
    return list(flat.cpu().split(lengths))


def pp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
