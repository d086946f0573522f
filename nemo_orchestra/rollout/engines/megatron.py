"""In-process generation with the trainer's own Megatron-Core model and a KV cache (``rollout.engine=megatron``),
or with a copy of it of the engine's own (``rollout.engine=megatron_copy``, ``MegatronCopyEngine``: rollouts ahead).

For machines without vLLM. The engine holds the live policy module (this rank's tensor-parallel
shard), so there is no second copy of the weights and nothing to sync: the next ``generate``
after an optimizer step reads the new parameters (``load_weights`` is a no-op, and the trainer
skips the weight gather for this engine).

Megatron's ``StaticInferenceContext`` is not used: it keeps one sequence offset for the whole
batch, so prompts of different lengths would need left padding, RoPE positions shifted by the
padding and a key-padding mask, and our packed core attention (``megatron/attention.py``) takes
no mask and runs each batch row as one causal sequence of the query's own length (a decode query
of length 1 against longer cached keys does not fit it). Its dynamic-batching engine (paged cache, CUDA
graphs of its own) requires flash-attn >= 2.7.3 or FlashAttention-3 for every attention call (an assert in
megatron-core 0.16.1's ``Attention.forward``), which a machine with PyTorch alone lacks. The
cache here is our own, and small:

- prefill: the prompts packed into one sequence (THD) and run through the model's own core
  attention with ``cu_seqlens``, as in training (same kernels, same RoPE positions, no padding);
  every layer's keys and values go into the cache, [R, L, Hkv, D] per layer (R >= B rows);
- decode: one token per unfinished sequence, at its own position (RoPE from per-token
  positions), attending to its row of the cache up to that position (SDPA with a length mask).

On CUDA at TP = 1 (``rollout.cuda_graphs``) the decode steps are static and replayed from CUDA graphs
(``_StaticDecode``), and the sampled tokens reach the host every ``sync_every`` steps, not every step. The
engine's work runs on a CUDA stream of its own (``engines/streams.py``).

Each layer's core attention is swapped for a cache-aware one for the duration of a ``generate``
call, and the forward runs the model's pieces (embedding -> decoder -> output layer) so that RoPE
can take per-token positions. Prompts are not padded, and every row (a static step's padding rows too)
attends only to its own cache row, so a prompt's generation does not depend on its batch (up to the
rounding of batched matrix multiplies); finished rows leave the decode batch.

Shapes (legend): B sequences, T tokens of one forward, N tokens whose next-token logits are
wanted, L cache length, Hq/Hkv query/key-value heads (this rank's), D head dim, V vocabulary.

Tensor parallelism: every rank of the TP group holds a slice of the heads and of the vocabulary,
and all of them run each forward together. ``generate`` is called on the group's first rank
(where the trainer's rollouts run); it sends the request to the other ranks, which wait in
``serve()`` until ``release()``. The output layer gathers the vocabulary (N x V per step), every
rank samples with the same seeded generators, and the first rank's tokens are broadcast so that
the ranks cannot drift apart. Pipeline parallelism, sequence parallelism and FP8 are refused at
construction.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_orchestra.rollout.engine_registry import ENGINES
from nemo_orchestra.rollout.engines.base import (
    EngineContext,
    Generation,
    GenerationEngine,
    check_seeds,
)
from nemo_orchestra.rollout.engines.sampling import row_generators, sample_rows
from nemo_orchestra.rollout.engines.streams import EngineStream

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

log = logging.getLogger(__name__)

_ALTERNATIVES = "use rollout.engine=vllm or rollout.engine=hf"


@dataclass
class _Step:
    """The tokens of one forward: cache row and position of each; packed lengths for a prefill; for a
    decode step, the cache length its attention reads (the largest position + 1, known on the host,
    so that no layer waits for the device to say it) and the mask of the positions each row attends to
    (made once a step, for every layer)."""

    rows_T: torch.Tensor
    pos_T: torch.Tensor
    prefill: PackedSeqParams | None = None  # the prompts' packed lengths (None: a decode step)
    length: int = 0
    mask_N11L: torch.Tensor | None = None

    def __post_init__(self):
        if self.prefill is None:
            self.mask_N11L = decode_mask(self.pos_T, self.length)


def _append_block(
    block: list[tuple[torch.Tensor, torch.Tensor]],
    rows: list[int],
    tokens: list[list[int]],
    logprobs: list[list[float]],
    finished: list[bool],
    stop_set: set[int],
) -> list[int]:
    """The tokens and logprobs of a block of steps (each [N] for the sequences ``rows``), copied to the host
    at once, appended to each sequence's up to and including its first stop token (a stopped sequence's
    later tokens in the block are dropped); returns the indices into ``rows`` of those still decoding."""
    ids_KN, lps_KN = (torch.stack(x) for x in zip(*block))
    ids_KN, lps_KN = torch.stack([ids_KN.to(lps_KN.dtype), lps_KN]).tolist()
    live = []
    for i, r in enumerate(rows):
        for ids_N, lps_N in zip(ids_KN, lps_KN):
            t = int(ids_N[i])
            tokens[r].append(t)
            logprobs[r].append(lps_N[i])
            if t in stop_set:
                finished[r] = True
                break
        else:
            live.append(i)
    return live


class _KVCache:
    """Keys and values of every layer, [R, L, Hkv, D] each (this rank's heads), for up to R sequences of up
    to L tokens. Cache row i is the i-th sequence still decoding: ``keep`` moves the rows of those still
    decoding to the front, in place, once, so that a decode step's attention reads the cache in place and
    the buffers never move (a captured decode step keeps their addresses)."""

    def __init__(self, num_layers: int, rows: int, length: int):
        self.rows, self.length = rows, length
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.step: _Step | None = None

    def write(self, layer: int, key_TKD: torch.Tensor, value_TKD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layers[layer] is None:  # shapes and dtype from the first keys: the TP shard's KV heads
            shape = (self.rows, self.length, *key_TKD.shape[1:])
            self.layers[layer] = (key_TKD.new_zeros(shape), value_TKD.new_zeros(shape))
        k_RLKD, v_RLKD = self.layers[layer]
        k_RLKD[self.step.rows_T, self.step.pos_T] = key_TKD
        v_RLKD[self.step.rows_T, self.step.pos_T] = value_TKD
        return k_RLKD, v_RLKD

    def keep(self, live: list[int]) -> None:
        """Rows ``live`` (ascending) become rows 0 .. N-1: only those from the first that moves are copied."""
        first = next((i for i, r in enumerate(live) if r != i), len(live))
        if first == len(live):
            return
        for kv in self.layers:
            if kv is not None:
                src = torch.tensor(live[first:], dtype=torch.long, device=kv[0].device)
                kv[0][first : len(live)] = kv[0][src]
                kv[1][first : len(live)] = kv[1][src]


class _CachedAttention(torch.nn.Module):
    """Stands in for one layer's core attention during generation: fills the cache, and attends
    through the original module (prefill) or over the cache (decode).

    Called by Megatron's attention as ``(query, key, value, attention_mask, attn_mask_type, ...)``
    with q [T, 1, Hq, D], k and v [T, 1, Hkv, D], RoPE already applied; returns [T, 1, Hq*D].
    """

    def __init__(self, inner: torch.nn.Module, cache: _KVCache, layer: int):
        super().__init__()
        self.inner, self.cache, self.layer = inner, cache, layer
        self.softmax_scale = getattr(inner, "softmax_scale", None)  # None: D**-0.5, as the inner module

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        T = query.shape[0]
        step = self.cache.step
        k_RLKD, v_RLKD = self.cache.write(self.layer, key[:, 0], value[:, 0])
        if step.prefill is not None:  # the training path: causal attention within each packed prompt
            out = self.inner(
                query[:, 0], key[:, 0], value[:, 0], None, attn_mask_type=attn_mask_type, packed_seq_params=step.prefill
            )
            return out.reshape(T, 1, -1)
        return decode_attention(query[:, 0], k_RLKD, v_RLKD, step.mask_N11L, self.softmax_scale)[:, None]


def decode_mask(pos_N: torch.Tensor, length: int) -> torch.Tensor:
    """Which of the first ``length`` cache positions row n attends to: 0 .. pos_n; [N, 1, 1, L]."""
    return (torch.arange(length, device=pos_N.device) <= pos_N[:, None])[:, None, None, :]


def decode_attention(
    q_NHD: torch.Tensor, k_RLKD: torch.Tensor, v_RLKD: torch.Tensor, mask_N11L: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """One decode token per cache row: token n (row n of the cache) attends to the positions of its row
    that ``mask_N11L`` (``decode_mask``) keeps, read in place up to the mask's length; [N, Hq*D].

    Query heads share a key-value head in groups of G = Hq / Hkv (head h reads group h // G, Megatron's and
    SDPA's order): the G queries of a group are one attention call's G query positions against that group's
    keys, so no key or value is repeated per query head."""
    N, Hq, D = q_NHD.shape
    Hkv, length = k_RLKD.shape[2], mask_N11L.shape[-1]
    k_NKLD, v_NKLD = k_RLKD[:N, :length].transpose(1, 2), v_RLKD[:N, :length].transpose(1, 2)
    out_NKGD = F.scaled_dot_product_attention(
        q_NHD.view(N, Hkv, Hq // Hkv, D), k_NKLD, v_NKLD, attn_mask=mask_N11L, scale=scale
    )
    return out_NKGD.reshape(N, Hq * D)


class MegatronEngine(GenerationEngine):
    """Generates with ``model``, the trainer's GPTModel (not a copy), KV-cached; see the module docstring."""

    def __init__(self, model: torch.nn.Module, device: torch.device, seed: int = 0, cuda_graphs: bool = True):
        config = model.config
        if config.pipeline_model_parallel_size > 1:
            raise ValueError(
                "rollout.engine=megatron does not support pipeline parallelism "
                f"(parallel.pp={config.pipeline_model_parallel_size}): {_ALTERNATIVES}"
            )
        if config.sequence_parallel:
            raise ValueError(
                "rollout.engine=megatron does not support parallel.sequence_parallel (it splits "
                "each forward's tokens over the TP ranks; a decode step has one per sequence): "
                f"{_ALTERNATIVES}"
            )
        if config.fp8:
            raise ValueError(
                "rollout.engine=megatron does not support model.fp8 (FP8 matrix multiplies need "
                f"token counts in multiples of 16; a decode step has one per sequence): {_ALTERNATIVES}"
            )
        self.model, self.device = model, device
        self._rope: torch.Tensor | None = None  # the RoPE table of the generate call in flight
        self.stream = EngineStream(device)
        # set by close(): a generate call in flight stops at its next token (one rank: with TP the ranks
        # decode in lockstep, and the call runs to its end)
        self.closed = threading.Event()
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.tp = config.tensor_model_parallel_size
        self.tp_group = self.tp_src = None
        if self.tp > 1:
            from megatron.core import parallel_state as ps

            self.tp_group = ps.get_tensor_model_parallel_group()
            self.tp_src = ps.get_tensor_model_parallel_src_rank()
            self.is_lead = ps.get_tensor_model_parallel_rank() == 0
        else:
            self.is_lead = True
        # how decode steps run: "dynamic" (a cache per call, each step its own shapes), "static" (the cache
        # and the step's inputs kept from call to call, steps padded to a few shapes), or "graphs" (static,
        # each shape captured once as a CUDA graph and replayed: on CUDA at TP=1, with rollout.cuda_graphs)
        self.decode = "graphs" if cuda_graphs and device.type == "cuda" and self.tp == 1 else "dynamic"
        if cuda_graphs and device.type == "cuda" and self.tp > 1 and self.is_lead:
            log.info("rollout.cuda_graphs: the megatron engine decodes eagerly at TP=%d (graphs need TP=1)", self.tp)
        # steps between two copies of the sampled tokens to the host (where stops are seen and finished
        # sequences leave): on CUDA the host queues the next steps meanwhile instead of waiting for each; a
        # sequence that stopped within a block decodes to the block's end, its extra tokens dropped. On a
        # CPU every step: the copy costs nothing there, the extra steps would.
        self.sync_every = 8 if device.type == "cuda" else 1
        self._static: _StaticDecode | None = None
        # decode shapes captured as CUDA graphs so far, and the host seconds their warm-up runs and captures
        # took: a run past its head start captures none (the benchmarks report those in measured steps)
        self.graphs_captured, self.capture_s = 0, 0.0

    # the trainer pushes no weights into it (Trainer.sync_weights); every TP rank runs its forwards
    capabilities = ENGINES["megatron"].capabilities  # registered in rollout/engine_registry.py

    @classmethod
    def create(cls, ctx: EngineContext, init_state=None) -> "MegatronEngine":
        if ctx.model is None:
            raise ValueError("the megatron engine generates with the policy's own model: pass model")
        return cls(ctx.model, ctx.device, seed=ctx.seed, cuda_graphs=_cuda_graphs(ctx))

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to load: ``generate`` reads the policy's parameters themselves."""

    # ---- the TP group: the first rank leads, the others follow -------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_ids: list[int],
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        """Token ids in, generated ids and their logprobs out (as ``HFEngine.generate``).

        temperature <= 0 is greedy decoding (logprobs then under temperature 1); otherwise sampling
        at ``temperature`` from the smallest set of tokens holding ``top_p`` of the probability,
        with logprobs under the temperature over the whole vocabulary. A sequence ends after a
        token of ``stop_ids`` (included, finished) or at ``max_new_tokens`` (not finished).
        With ``seeds``, each sequence samples from a generator of its own (``engines/sampling.py``).
        """
        if not self.is_lead:
            raise RuntimeError(
                "rollout.engine=megatron: generate runs on the first rank of the tensor-parallel "
                "group; the other ranks call serve()"
            )
        if self.closed.is_set():
            raise RuntimeError("megatron engine: generate called after close()")
        check_seeds(seeds, len(prompts), "megatron")
        request = (prompts, max_new_tokens, temperature, top_p, stop_ids, seeds)
        self._broadcast_request(request)
        return self._generate(*request)

    def serve(self) -> None:
        """On the other ranks of the TP group: run the first rank's generate calls until ``release()``."""
        if self.is_lead:
            return
        while (request := self._broadcast_request(None)) is not None:
            self._generate(*request)

    def release(self) -> None:
        """On the first rank: end the other ranks' ``serve()``."""
        if self.is_lead:
            self._broadcast_request(None)

    def close(self) -> None:
        self.closed.set()
        self._static = None  # its cache and graphs, once a call in flight (which holds them) ends

    def _broadcast_request(self, request):
        if self.tp == 1:
            return request
        box = [request]
        with self.stream.run(after_trainer=False):  # on this rank's device, from whichever thread calls
            dist.broadcast_object_list(box, src=self.tp_src, group=self.tp_group)
        return box[0]

    # ---- generation ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_ids: list[int],
        seeds: list[int] | None,
    ) -> list[Generation]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("rollout.engine=megatron: a prompt has no tokens")
        model, dev = self.model, self.device
        B = len(prompts)
        lengths = [len(p) for p in prompts]
        lengths_B = torch.tensor(lengths, device=dev)
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        finished = [False] * B
        stop_set = set(stop_ids)
        was_training = model.training
        layers = [layer.self_attention for layer in model.decoder.layers]
        originals = [attention.core_attention for attention in layers]
        with self.stream.run(after_trainer=self.capabilities.reads_policy_weights):
            generators = row_generators(seeds, dev) if seeds is not None and temperature > 0 else None
            if self.decode == "dynamic":
                cache = _KVCache(len(layers), B, max(lengths) + max_new_tokens)
                self._rope = None
                step_fn = self._decode_step
            else:
                step_fn = _StaticDecode.for_call(self, B, max(lengths) + max_new_tokens)
                cache = step_fn.cache
            try:
                model.eval()
                for i, attention in enumerate(layers):
                    attention.core_attention = _CachedAttention(originals[i], cache, i)
                logits_NV = self._prefill(prompts, lengths_B, cache)
                rows = list(range(B))  # the sequences still decoding, in cache-row order
                start_N = lengths_B  # where each one's generated tokens start
                longest = max(lengths)  # their longest prompt
                block: list[tuple[torch.Tensor, torch.Tensor]] = []  # tokens sampled since the last host copy
                for n in range(1, max_new_tokens + 1):  # n: the tokens each row has once this one is sampled
                    ids_N, lp_N = self._sample(
                        logits_NV, temperature, top_p, None if generators is None else [generators[r] for r in rows]
                    )
                    block.append((ids_N, lp_N))
                    if len(block) == self.sync_every or n == max_new_tokens:
                        live = _append_block(block, rows, tokens, logprobs, finished, stop_set)
                        block = []
                        if not live or n == max_new_tokens or (self.tp == 1 and self.closed.is_set()):
                            break
                        if len(live) < len(rows):
                            keep_N = torch.tensor(live, dtype=torch.long, device=dev)
                            ids_N, start_N = ids_N[keep_N], start_N[keep_N]
                            rows = [rows[i] for i in live]
                            longest = max(lengths[r] for r in rows)
                            cache.keep(live)
                    # token n - 1 sits after its prompt
                    logits_NV = step_fn(cache, ids_N, start_N + n - 1, longest + n)
            finally:
                for attention, original in zip(layers, originals):
                    attention.core_attention = original
                model.train(was_training)
        return [Generation(t, lp, f) for t, lp, f in zip(tokens, logprobs, finished)]

    def _decode_step(self, cache: _KVCache, ids_N: torch.Tensor, pos_N: torch.Tensor, length: int) -> torch.Tensor:
        """One token of each of the N sequences still decoding (cache rows 0 .. N-1) at positions ``pos_N``,
        all below ``length``: their next-token logits [N, V]."""
        rows_N = torch.arange(len(ids_N), device=self.device)
        cache.step = _Step(rows_N, pos_N, length=length)
        return self._forward(ids_N, pos_N, length=length)

    def _prefill(self, prompts: list[list[int]], lengths_B: torch.Tensor, cache: _KVCache) -> torch.Tensor:
        """The prompts packed into one sequence; the logits after each prompt's last token, [B, V]."""
        from megatron.core.packed_seq_params import PackedSeqParams

        dev = self.device
        ids_T = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
        rows_T = torch.repeat_interleave(torch.arange(len(prompts), device=dev), lengths_B)
        cu_B1 = F.pad(torch.cumsum(lengths_B, 0), (1, 0)).to(torch.int32)
        pos_T = torch.arange(len(ids_T), device=dev) - cu_B1[:-1].long()[rows_T]
        longest = int(lengths_B.max())
        packed = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_B1, cu_seqlens_kv=cu_B1, max_seqlen_q=longest, max_seqlen_kv=longest
        )
        cache.step = _Step(rows_T, pos_T, packed)
        return self._forward(ids_T, pos_T, last_N=cu_B1[1:].long() - 1, length=longest)

    def _forward(
        self, ids_T: torch.Tensor, pos_T: torch.Tensor, last_N: torch.Tensor | None = None, length: int = 0
    ) -> torch.Tensor:
        """GPTModel.forward for tokens at given positions (all below ``length``): full-vocabulary
        logits [N, V] of the tokens ``last_N`` (default: all). The RoPE table is made once a
        generate call (``self._rope``, reset at its start; kept with a static decode's cache), and again
        only for a longer sequence."""
        m = self.model
        hidden_T1H = m.embedding(input_ids=ids_T[None], position_ids=pos_T[None])
        if self._rope is None or self._rope.shape[0] < length:
            self._rope = m.rotary_pos_emb(max(m.max_sequence_length, length))
        rope_T11D = self._rope[pos_T]
        hidden_T1H = m.decoder(hidden_states=hidden_T1H, attention_mask=None, rotary_pos_emb=rope_T11D)
        if last_N is not None:
            hidden_T1H = hidden_T1H[last_N]
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits_N1V, _ = m.output_layer(hidden_T1H, weight=weight, runtime_gather_output=True)
        return logits_N1V[:, 0]

    def _sample(
        self,
        logits_NV: torch.Tensor,
        temperature: float,
        top_p: float,
        generators: list[torch.Generator] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token of each row and its log p under the temperature (1 when greedy); ``generators``:
        one per row, else the engine's own for the whole batch."""
        greedy = temperature <= 0
        lp_NV = torch.log_softmax(logits_NV.float() / (1.0 if greedy else temperature), dim=-1)
        if greedy:
            ids_N = lp_NV.argmax(dim=-1)
        else:
            probs_NV = lp_NV.exp()
            if top_p < 1.0:  # nucleus: the most likely tokens until their mass reaches top_p
                sorted_NV, order_NV = probs_NV.sort(dim=-1, descending=True)
                keep_NV = sorted_NV.cumsum(dim=-1) - sorted_NV < top_p
                probs_NV = torch.zeros_like(probs_NV).scatter_(-1, order_NV, sorted_NV * keep_NV)
            if generators is not None:
                ids_N = sample_rows(probs_NV, generators)
            else:
                ids_N = torch.multinomial(probs_NV, 1, generator=self.generator)[:, 0]
        if self.tp > 1:  # the first rank's choice, so that the ranks decode the same sequences
            dist.broadcast(ids_N, src=self.tp_src, group=self.tp_group)
        return ids_N, lp_NV.gather(-1, ids_N[:, None])[:, 0]


class MegatronCopyEngine(MegatronEngine):
    """The megatron engine on a model of its own (``rollout.engine=megatron_copy``): built like the
    policy (same layout, this rank's shard of every weight, never trained) and loaded from the
    policy's full weights at each weight sync. It generates with the policy version it was last
    given while the trainer updates the live one, so rollouts can run ahead (``rollout.steps_ahead``);
    the cost is a second copy of this rank's weights. Its tokens are the megatron engine's on the same
    weights."""

    capabilities = ENGINES["megatron_copy"].capabilities  # registered in rollout/engine_registry.py

    @classmethod
    def create(cls, ctx: EngineContext, init_state=None) -> "MegatronCopyEngine":
        if ctx.parallel is None:
            raise ValueError("the megatron_copy engine builds a model like the policy's: pass parallel")
        from nemo_orchestra.megatron.model import build_gpt_model

        # its parameters keep requires_grad as the policy's do (generation runs without autograd): with
        # TP, Megatron's parallel linears take another path for frozen weights, and round otherwise
        model = build_gpt_model(ctx.model_cfg, ctx.parallel, ctx.vocab_size, ctx.device, initialize=False)
        engine = cls(model, ctx.device, seed=ctx.seed, cuda_graphs=_cuda_graphs(ctx))
        if init_state is not None:
            engine.load_weights(init_state)
        return engine

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """The policy's full weights (Megatron names, as ``export.qwen3.full_state_dict`` gathers them):
        this rank's shard of each copied into the engine's model."""
        from nemo_orchestra.megatron.sharding import load_full_state

        with self.stream.run(after_trainer=True):
            load_full_state(self.model, state.__getitem__, list(state))


def _cuda_graphs(ctx: EngineContext) -> bool:
    return True if ctx.rollout is None else bool(ctx.rollout.cuda_graphs)


def padded_rows(n: int, most: int) -> int:
    """The decode batch a static step runs for ``n`` sequences: 1, 2, 4, 8 or the next multiple of 16,
    at most ``most`` (a cache's rows)."""
    return min(most, 1 << (n - 1).bit_length() if n <= 8 else -(-n // 16) * 16)


def padded_length(n: int, most: int) -> int:
    """The cache length a static step's attention reads for ``n`` positions: the next multiple of 256, at
    most ``most`` (a cache's length)."""
    return min(most, -(-n // 256) * 256)


class _StaticDecode:
    """Decode steps of fixed shapes on a cache kept from call to call (``MegatronEngine.decode``: "static"
    or "graphs").

    A step of N sequences at cache length ``length`` runs as ``padded_rows(N)`` rows reading
    ``padded_length(length)`` positions: the tokens and positions go into buffers of the cache's rows,
    the rows after N carry token 0 at position 0 (they write keys and values into cache rows no sequence
    holds, and their logits are not read), and the attention's mask hides every position after a row's
    own. So a call meets a few shapes, the same from call to call. With ``capture`` (CUDA), each shape's
    step is captured once as a CUDA graph, on its first use (after one eager run of it on the engine's
    stream, which warms the kernels and writes the same keys and values the replay does), and replayed
    from then on: one launch a step instead of the model's hundreds of kernels. The graphs share one
    memory pool (only one runs at a time) and leave their logits in one buffer, read before the next step.

    The cache, the buffers, the RoPE table and the graphs live until a call needs more rows or a longer
    cache than they hold, then are made again at the larger size: at most the live sequences of a run at
    its ``rollout.max_context``, what one call may need anyway. The forward reads the model's parameters in
    place, so a captured step reads the weights of the moment it replays."""

    def __init__(self, engine: "MegatronEngine", rows: int, length: int, capture: bool):
        dev = engine.device
        self.engine, self.capture = engine, capture
        self.cache = _KVCache(len(engine.model.decoder.layers), rows, length)
        self.ids_R = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos_R = torch.zeros(rows, dtype=torch.long, device=dev)
        self.rows_R = torch.arange(rows, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits_RV: torch.Tensor | None = None  # where every graph leaves its step's logits
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        m = engine.model  # the RoPE table for the whole cache, kept: a captured step reads it where it is
        engine._rope = m.rotary_pos_emb(max(m.max_sequence_length, length))

    @classmethod
    def for_call(cls, engine: "MegatronEngine", rows: int, length: int) -> "_StaticDecode":
        """The engine's (``engine._static``) if it has ``rows`` rows of ``length`` positions, else a new one
        that has, and has the rows and length the old one had (rows padded as a step pads them, length to a
        multiple of 256), made once the old one is released, so that the two are never held at once."""
        held, capture = engine._static, engine.decode == "graphs"
        if held is not None and held.capture == capture and held.cache.rows >= rows and held.cache.length >= length:
            return held
        if held is not None:
            rows, length = max(rows, held.cache.rows), max(length, held.cache.length)
            engine._static = held = None
        rows, length = padded_rows(rows, rows + 15), padded_length(length, length + 255)
        engine._static = cls(engine, rows, length, capture=capture)
        return engine._static

    def __call__(self, cache: _KVCache, ids_N: torch.Tensor, pos_N: torch.Tensor, length: int) -> torch.Tensor:
        """As ``MegatronEngine._decode_step``, on this cache."""
        n = len(ids_N)
        rows, length = padded_rows(n, self.cache.rows), padded_length(length, self.cache.length)
        self.ids_R[:n], self.pos_R[:n] = ids_N, pos_N
        self.ids_R[n:rows], self.pos_R[n:rows] = 0, 0
        if not self.capture:
            return self._step(rows, length)[:n]
        if (rows, length) not in self.graphs:
            t0 = time.perf_counter()
            logits_NV = self._step(rows, length)  # warm-up: writes the keys and values the replay writes again
            if self.logits_RV is None:
                self.logits_RV = logits_NV.new_empty((self.cache.rows, logits_NV.shape[1]))
            graph = torch.cuda.CUDAGraph()
            # thread_local: the trainer's thread may allocate and synchronise meanwhile (rollouts ahead)
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.logits_RV[:rows].copy_(self._step(rows, length))
            self.graphs[rows, length] = graph
            self.engine.graphs_captured += 1
            self.engine.capture_s += time.perf_counter() - t0
        self.graphs[rows, length].replay()
        return self.logits_RV[:n]

    def _step(self, rows: int, length: int) -> torch.Tensor:
        self.cache.step = _Step(self.rows_R[:rows], self.pos_R[:rows], length=length)
        return self.engine._forward(self.ids_R[:rows], self.pos_R[:rows], length=length)
