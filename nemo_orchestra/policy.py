"""The trainable policy: Megatron-Core model, reference copy, optimizer, packed forward/backward.

Every forward goes through Megatron's pipeline schedule (``get_forward_backward_func``): with
PP = 1 it is a plain loop over microbatches, with PP > 1 the 1F1B schedule, whose p2p shapes are
fixed, so every pack of a step must have the same length (the trainer pads them). Logprobs and
entropy come from the vocab-parallel logits (``megatron/vocab_parallel.py``) on the last stage;
the forward-only pass broadcasts its logprobs to the other stages.

The frozen reference (for the KL term) is sharded like the policy. With ``reference.offload``
its weights live in CPU memory and are swapped into the policy's model for its forward.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from nemo_orchestra.config import Config, LossConfig, OptimConfig, ParallelConfig
from nemo_orchestra.grpo.loss import policy_loss, tis_weights
from nemo_orchestra.megatron.model import build_gpt_model
from nemo_orchestra.megatron.vocab_parallel import logprobs_and_entropy
from nemo_orchestra.packing import pack
from nemo_orchestra.types import PackedBatch, Trajectory

log = logging.getLogger(__name__)


@dataclass
class Policy:
    model: torch.nn.Module  # Megatron DDP-wrapped GPTModel (this rank's pipeline stage and TP shard)
    optimizer: object  # Megatron (distributed) optimizer
    reference: torch.nn.Module  # frozen copy for the KL term, sharded like the model
    device: torch.device
    reference_offloaded: bool = False  # the reference's weights are in CPU memory

    @property
    def module(self):
        return self.model.module

    @torch.no_grad()
    def reset_reference(self) -> None:
        """The reference becomes a copy of the current weights (after the warm start)."""
        for p, r in zip(self.module.parameters(), self.reference.parameters(), strict=True):
            r.copy_(p)

    @contextlib.contextmanager
    def reference_model(self):
        """The module to run for reference logprobs (the policy's, holding the reference weights if offloaded)."""
        if not self.reference_offloaded:
            yield self.reference
            return
        params = [p for _, p in self.module.named_parameters()]
        refs = [r for _, r in self.reference.named_parameters()]
        saved = [p.detach().to("cpu", copy=True) for p in params]
        with torch.no_grad():
            for p, r in zip(params, refs):
                p.copy_(r, non_blocking=True)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s, non_blocking=True)


def build_policy(cfg: Config, vocab_size: int, device: torch.device) -> Policy:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from nemo_orchestra.megatron.sharding import load_local_state, model_state

    gpt = build_gpt_model(cfg.model, cfg.parallel, vocab_size, device, initialize=not cfg.model.init_from)
    if cfg.model.init_from:
        load_pretrained(gpt, cfg.model.init_from, cfg.model)
    ref_device = torch.device("cpu") if cfg.reference.offload else device
    reference = build_gpt_model(cfg.model, cfg.parallel, vocab_size, device, initialize=False).to(ref_device).eval()
    load_local_state(reference, {k: v.to(ref_device) for k, v in model_state(gpt).items()})
    for p in reference.parameters():
        p.requires_grad_(False)
        if cfg.reference.offload and torch.cuda.is_available():
            p.data = p.data.pin_memory()  # host-to-device copies at full PCIe speed
    ddp = DistributedDataParallel(
        gpt.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      use_distributed_optimizer=cfg.parallel.distributed_optimizer),
        gpt,
    )
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = ddp.no_sync
    optimizer = build_optimizer(ddp, cfg.optim, cfg.parallel.distributed_optimizer, cfg.model.params_dtype)
    return Policy(ddp, optimizer, reference, device, reference_offloaded=cfg.reference.offload)


def load_pretrained(gpt, folder: str, model_cfg) -> None:
    """Weights from ``model.init_from``: a Hugging Face folder or a nemo-orchestra checkpoint."""
    import os

    from nemo_orchestra.hf.qwen3 import (HFWeights, hf_to_megatron_tensor, megatron_names, model_config_from_hf,
                                         read_hf_config)
    from nemo_orchestra.megatron import dist_ckpt
    from nemo_orchestra.megatron.sharding import load_full_state

    if not os.path.isdir(folder):
        raise ValueError(f"model.init_from: no such folder {folder!r}")
    if dist_ckpt.is_checkpoint(folder):
        dist_ckpt.check_model_config(folder, model_cfg)
        _check_vocab(dist_ckpt.read_meta(folder)["vocab_size"], gpt.vocab_size, folder)
        dist_ckpt.load_model(gpt, folder)
    elif os.path.isfile(os.path.join(folder, "config.json")):
        hf_cfg = read_hf_config(folder)
        check_same_architecture(model_config_from_hf(hf_cfg, model_cfg), model_cfg, folder)
        _check_vocab(hf_cfg["vocab_size"], gpt.vocab_size, folder)
        weights = HFWeights(folder)
        dtype = gpt.config.params_dtype
        load_full_state(gpt, lambda n: hf_to_megatron_tensor(n, weights.__getitem__, model_cfg).to(dtype),
                        megatron_names(model_cfg))
    else:
        raise ValueError(f"model.init_from: {folder!r} is neither a Hugging Face folder nor a checkpoint")
    log.info("initialized the policy from %s", folder)


ARCH_KEYS = ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim", "ffn_hidden_size",
             "tie_embeddings", "qk_norm", "rope_theta", "norm_eps")


def _check_vocab(found: int, ours: int, where: str) -> None:
    if found != ours:
        raise ValueError(f"model.init_from={where}: the checkpoint's vocabulary has {found} entries, the model "
                         f"{ours} (set model.vocab_size={found})")


def check_same_architecture(found, model_cfg, where: str) -> None:
    diff = [f"model.{k}={getattr(model_cfg, k)} (checkpoint: {getattr(found, k)})"
            for k in ARCH_KEYS if getattr(found, k) != getattr(model_cfg, k)]
    if diff:
        raise ValueError(f"model.init_from={where}: the checkpoint's architecture differs: " + ", ".join(diff))


def build_optimizer(ddp, cfg: OptimConfig, distributed: bool, params_dtype: str, lr: float | None = None):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from nemo_orchestra.megatron.cpu_compat import cuda_type_names

    ocfg = OptimizerConfig(
        optimizer="adam", lr=lr or cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.grad_clip,
        use_distributed_optimizer=distributed, bf16=params_dtype == "bf16", fp16=params_dtype == "fp16",
        params_dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[params_dtype],
    )
    with cuda_type_names():
        return get_megatron_optimizer(ocfg, [ddp])


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def reset_optimizer_state(optimizer) -> None:
    """Zero the moments and step counts, in place: the next step is a fresh Adam's first step.

    Between the warm start and GRPO: Adam's second moment decays with time constant
    1 / (1 - beta2) = 1000 steps, so moments left from supervised gradients (several times the size
    of policy-gradient ones) would shrink GRPO's steps well below ``optim.lr`` for its whole run."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)  # Megatron's wrapper holds the torch optimizer
        for state in inner.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    v.zero_()
        for group in inner.param_groups:
            if "step" in group:  # optimizers that count steps per group (TE's FusedAdam)
                group["step"] = 0


def pack_for_step(trajs: list[Trajectory], parallel: ParallelConfig) -> list[PackedBatch]:
    """The step's microbatches; collective over the data-parallel and model-parallel groups.

    Packs are padded to a TP multiple, and under PP all to one length (``microbatch_tokens``, or the
    longest trajectory if longer). Empty when no data-parallel rank has a token to train on; when
    only this rank has none, one all-padding pack, so that every rank joins the gradient reduction.
    The ranks of one model replica all get the packs of its first rank (they must see one batch).
    """
    from nemo_orchestra.megatron.parallel import broadcast_in_model_parallel_group, data_parallel_sum

    length = None
    if parallel.pp > 1:
        length = max([parallel.microbatch_tokens] + [len(t.token_ids) for t in trajs])
    batches = pack(trajs, parallel.microbatch_tokens, pad_to_multiple=parallel.tp, pad_to_length=length)
    tokens = data_parallel_sum([sum(float(b.loss_mask_T.sum()) for b in batches)])[0]
    if tokens == 0:
        return []
    return broadcast_in_model_parallel_group(batches or [padding_pack(length or parallel.tp, parallel.tp)])


def padding_pack(length: int, multiple: int = 1) -> PackedBatch:
    T = -(-length // multiple) * multiple
    zeros = torch.zeros(T, dtype=torch.long)
    return PackedBatch(input_ids_T=zeros, position_ids_T=torch.arange(T), target_ids_T=zeros,
                       loss_mask_T=torch.zeros(T), advantages_T=torch.zeros(T), old_logprobs_T=torch.zeros(T),
                       ref_logprobs_T=torch.zeros(T), cu_seqlens_B1=torch.tensor([0, T], dtype=torch.int32),
                       max_seqlen=T, traj_index_B=[-1], gen_logprobs_T=torch.zeros(T))


def _packed_params(batch: PackedBatch, device):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch.cu_seqlens_B1.to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=batch.max_seqlen, max_seqlen_kv=batch.max_seqlen)


def _forward(m, batch: PackedBatch, device):
    return m(batch.input_ids_T[None].to(device), batch.position_ids_T[None].to(device), None,
             packed_seq_params=_packed_params(batch, device))


def token_logprobs(logits_1TV: torch.Tensor, target_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) from (vocab-parallel) logits without gathering the vocabulary."""
    return logprobs_and_entropy(logits_1TV[0], target_T, temperature)[0]


def _schedule(model, forward_step, batches: list[PackedBatch], forward_only: bool, collect: bool = False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    lengths = {b.num_tokens for b in batches}
    if len(lengths) > 1 and _pp_size() > 1:
        raise ValueError(f"pipeline parallelism needs packs of one length, got {sorted(lengths)} "
                         "(pack with pad_to_length)")
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=model, num_microbatches=len(batches),
        seq_length=max(lengths), micro_batch_size=1, forward_only=forward_only, collect_non_loss_data=collect,
    )


@torch.no_grad()
def forward_logprobs(model: torch.nn.Module, batches: PackedBatch | list[PackedBatch], device,
                     temperature: float = 1.0) -> torch.Tensor | list[torch.Tensor]:
    """Token logprobs of each pack (forward only, through the pipeline), on every stage, on the CPU."""
    single = isinstance(batches, PackedBatch)
    batches = [batches] if single else list(batches)
    if not batches:
        return []
    model.eval()

    def forward_step(data_iterator, m):
        batch = next(data_iterator)
        out = _forward(m, batch, device)

        def collect(output, non_loss_data=True):
            return token_logprobs(output, batch.target_ids_T.to(output.device), temperature).cpu()

        return out, collect

    store = _schedule(model, forward_step, batches, forward_only=True, collect=True)
    out = _from_last_stage(store, [b.num_tokens for b in batches])
    return out[0] if single else out


def _from_last_stage(tensors: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
    """The last pipeline stage's per-pack fp32 tensors, broadcast to every stage."""
    from megatron.core import parallel_state as ps

    if _pp_size() == 1:
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


def _pp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def reference_logprobs(policy: Policy, batches: list[PackedBatch], temperature: float = 1.0) -> list[torch.Tensor]:
    with policy.reference_model() as model:
        return forward_logprobs(model, batches, policy.device, temperature)


def grpo_loss_fn(loss_cfg: LossConfig):
    """The GRPO loss of a pack. Its old logprobs are the pack's ``old_logprobs_T`` or, when that is
    None, the update's own forward, detached: with one optimizer step per batch of rollouts the
    policy that sampled them (as the trainer computes it) is the policy being updated, so a separate
    forward pass would give the same numbers (the ratio starts at 1 either way; TRL's GRPO trainer
    does the same when it takes one step per generation). Also reports
    ``rollout/logprob_mismatch``, mean |trainer - generator| logprob over generated tokens."""
    def fn(lp_T: torch.Tensor, batch: PackedBatch):
        dev = lp_T.device
        old = lp_T.detach() if batch.old_logprobs_T is None else batch.old_logprobs_T.to(dev)
        weights = None
        if loss_cfg.tis_cap is not None:
            assert batch.gen_logprobs_T is not None, "loss.tis_cap needs the generator's logprobs in the pack"
            weights = tis_weights(old, batch.gen_logprobs_T.to(dev), loss_cfg.tis_cap)
        mask = batch.loss_mask_T.to(dev)
        loss_sum, n, metrics = policy_loss(lp_T, old, batch.ref_logprobs_T.to(dev), batch.advantages_T.to(dev), mask,
                                           loss_cfg, is_weights_T=weights)
        if batch.gen_logprobs_T is not None:
            gap = (old - batch.gen_logprobs_T.to(dev)).abs()
            metrics["rollout/logprob_mismatch"] = (gap * mask).sum() / mask.sum().clamp_min(1.0)
        return loss_sum, n, metrics

    return fn


def sft_loss_fn(lp_T: torch.Tensor, batch: PackedBatch):
    """Summed negative log-likelihood of the generated (assistant) tokens."""
    mask = batch.loss_mask_T.to(lp_T.device)
    n = mask.sum()
    nll = -(lp_T * mask).sum()
    return nll, n, {"loss/nll": nll.detach() / n.clamp_min(1.0), "loss/tokens": n}


def _loss_func(batch: PackedBatch, loss_fn, temperature: float, logits):
    lp, ent = logprobs_and_entropy(logits[0], batch.target_ids_T.to(logits.device), temperature)
    loss_sum, n, metrics = loss_fn(lp, batch)
    mask = batch.loss_mask_T.to(ent.device)
    metrics["train/entropy"] = (ent * mask).sum() / mask.sum().clamp_min(1.0)
    return loss_sum, n.to(torch.int), metrics


def forward_backward(policy: Policy, batches: list[PackedBatch], loss_fn, temperature: float = 1.0) -> list[dict]:
    """Gradients of the step's summed loss / its global token count, in the DDP grad buffers.

    Returns the last stage's per-microbatch metrics (an empty list on other stages).
    """
    model, device = policy.model, policy.device
    model.train()
    model.zero_grad_buffer()
    policy.optimizer.zero_grad()

    def forward_step(data_iterator, m):
        batch = next(data_iterator)
        return _forward(m, batch, device), partial(_loss_func, batch, loss_fn, temperature)

    return _schedule(model, forward_step, batches, forward_only=False)


def train_step(policy: Policy, batches: list[PackedBatch], loss_fn, temperature: float = 1.0) -> dict:
    """One optimizer step over all microbatches (gradients summed, scaled by 1/global tokens)."""
    from nemo_orchestra.megatron.cpu_compat import cuda_type_names

    losses = forward_backward(policy, batches, loss_fn, temperature)
    with cuda_type_names():
        ok, grad_norm, _ = policy.optimizer.step()
    if not ok:
        log.warning("optimizer step skipped (non-finite gradients)")
    out = {"train/grad_norm": float(grad_norm or 0.0), "train/step_skipped": float(not ok)}
    out.update(reduce_metrics(losses))
    return out


def reduce_metrics(losses: list[dict]) -> dict[str, float]:
    """Token-weighted means of the microbatch metrics over the whole step (all stages, all DP ranks)."""
    from megatron.core import parallel_state as ps

    from nemo_orchestra.megatron.parallel import data_parallel_sum

    sums: dict[str, float] = {}
    for d in losses:
        n = float(d["loss/tokens"])
        for k, v in d.items():
            sums[k] = sums.get(k, 0.0) + (n if k == "loss/tokens" else float(v) * n)
    if _pp_size() > 1:  # metrics exist on the last stage only
        box = [sums]
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
        sums = box[0]
    if not sums:
        return {}
    keys = sorted(sums)
    total = dict(zip(keys, data_parallel_sum([sums[k] for k in keys])))
    toks = total.pop("loss/tokens")
    out = {k: v / max(toks, 1.0) for k, v in total.items()}
    out["train/loss_tokens"] = toks
    return out
