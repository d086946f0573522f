"""The trainable policy: Megatron-Core model, reference copy, optimizer, packed forward/backward."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch

from nemo_orchestra.config import Config, LossConfig, OptimConfig
from nemo_orchestra.grpo.loss import policy_loss
from nemo_orchestra.megatron.model import build_gpt_model
from nemo_orchestra.types import PackedBatch

log = logging.getLogger(__name__)


@dataclass
class Policy:
    model: torch.nn.Module  # Megatron DDP-wrapped GPTModel
    optimizer: object  # Megatron (distributed) optimizer
    reference: torch.nn.Module  # frozen copy of the initial weights, for the KL term
    device: torch.device

    @property
    def module(self):
        return self.model.module


def build_policy(cfg: Config, vocab_size: int, device: torch.device, init_state: dict | None = None) -> Policy:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    gpt = build_gpt_model(cfg.model, cfg.parallel, vocab_size, device)
    if init_state is not None:
        missing, unexpected = gpt.load_state_dict(init_state, strict=False)
        missing = [k for k in missing if "_extra_state" not in k]
        if missing or unexpected:
            raise ValueError(f"model.init_from: weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    reference = build_gpt_model(cfg.model, cfg.parallel, vocab_size, device).eval()
    reference.load_state_dict(gpt.state_dict())
    for p in reference.parameters():
        p.requires_grad_(False)
    ddp = DistributedDataParallel(
        gpt.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      use_distributed_optimizer=cfg.parallel.distributed_optimizer),
        gpt,
    )
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = ddp.no_sync
    optimizer = build_optimizer(ddp, cfg.optim, cfg.parallel.distributed_optimizer, cfg.model.params_dtype)
    return Policy(ddp, optimizer, reference, device)


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


def _packed_params(batch: PackedBatch, device):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch.cu_seqlens_B1.to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=batch.max_seqlen, max_seqlen_kv=batch.max_seqlen)


def token_logprobs(logits_1TV: torch.Tensor, target_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) from (vocab-parallel) logits without gathering the vocabulary."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits_T1V = logits_1TV.transpose(0, 1).float()
    if temperature != 1.0:
        logits_T1V = logits_T1V / temperature
    return -vocab_parallel_cross_entropy(logits_T1V, target_T[:, None])[:, 0]


@torch.no_grad()
def forward_logprobs(model: torch.nn.Module, batch: PackedBatch, device, temperature: float = 1.0) -> torch.Tensor:
    model.eval()
    logits = model(batch.input_ids_T[None].to(device), batch.position_ids_T[None].to(device), None,
                   packed_seq_params=_packed_params(batch, device))
    return token_logprobs(logits, batch.target_ids_T.to(device), temperature).cpu()


def grpo_loss_fn(loss_cfg: LossConfig):
    def fn(lp_T: torch.Tensor, batch: PackedBatch):
        dev = lp_T.device
        return policy_loss(lp_T, batch.old_logprobs_T.to(dev), batch.ref_logprobs_T.to(dev),
                           batch.advantages_T.to(dev), batch.loss_mask_T.to(dev), loss_cfg)

    return fn


def sft_loss_fn(lp_T: torch.Tensor, batch: PackedBatch):
    """Summed negative log-likelihood of the generated (assistant) tokens."""
    mask = batch.loss_mask_T.to(lp_T.device)
    n = mask.sum()
    nll = -(lp_T * mask).sum()
    return nll, n, {"loss/nll": nll.detach() / n.clamp_min(1.0), "loss/tokens": n}


def _loss_func(batch: PackedBatch, loss_fn, temperature: float, logits):
    lp = token_logprobs(logits, batch.target_ids_T.to(logits.device), temperature)
    loss_sum, n, metrics = loss_fn(lp, batch)
    return loss_sum, n.to(torch.int), metrics


def train_step(policy: Policy, batches: list[PackedBatch], loss_fn, temperature: float = 1.0) -> dict:
    """One optimizer step over all microbatches (gradients summed, scaled by 1/global tokens)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from nemo_orchestra.megatron.cpu_compat import cuda_type_names

    model, device = policy.model, policy.device
    model.train()
    model.zero_grad_buffer()
    policy.optimizer.zero_grad()

    def forward_step(data_iterator, m):
        batch = next(data_iterator)
        logits = m(batch.input_ids_T[None].to(device), batch.position_ids_T[None].to(device), None,
                   packed_seq_params=_packed_params(batch, device))
        return logits, partial(_loss_func, batch, loss_fn, temperature)

    max_len = max(b.num_tokens for b in batches)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=model,
        num_microbatches=len(batches), seq_length=max_len, micro_batch_size=1, forward_only=False,
    )
    with cuda_type_names():
        ok, grad_norm, _ = policy.optimizer.step()
    if not ok:
        log.warning("optimizer step skipped (non-finite gradients)")
    out = {"train/grad_norm": float(grad_norm or 0.0), "train/step_skipped": float(not ok)}
    if losses:
        toks = sum(float(d["loss/tokens"]) for d in losses)
        for k in losses[0]:
            if k != "loss/tokens":
                out[k] = sum(float(d[k]) * float(d["loss/tokens"]) for d in losses) / max(toks, 1.0)
        out["train/loss_tokens"] = toks
    return out
