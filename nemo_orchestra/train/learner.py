"""The learner: the trainable Megatron-Core model (the policy being trained), its frozen reference copy
and optimizer.

The frozen reference (for the KL term) is sharded like the policy. With ``reference.offload``
its weights live in CPU memory and are swapped into the policy's model for its forward.
``model.init_from`` loads a Hugging Face folder or a nemo-orchestra checkpoint into it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field

import torch

from nemo_orchestra.config import Config, OptimConfig
from nemo_orchestra.megatron.model import (
    DTYPES,
    build_gpt_model,
    check_same_architecture,
    check_vocab,
)
from nemo_orchestra.train.divergence import StepGuard, any_rank, first_non_finite

log = logging.getLogger(__name__)


@dataclass
class Learner:
    model: torch.nn.Module  # Megatron DDP-wrapped GPTModel (this rank's pipeline stage and TP shard)
    optimizer: object  # Megatron (distributed) optimizer
    reference: torch.nn.Module  # frozen copy for the KL term, sharded like the model
    device: torch.device
    reference_offloaded: bool = False  # the reference's weights are in CPU memory
    guard: StepGuard = field(default_factory=StepGuard)  # skipped steps and divergence (train/divergence.py)

    @property
    def module(self):
        return self.model.module

    @torch.no_grad()
    def reset_reference(self) -> None:
        """The reference becomes a copy of the current weights (after the warm start; at ``reference.reset_every``)."""
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


def build_learner(cfg: Config, vocab_size: int, device: torch.device) -> Learner:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from nemo_orchestra.megatron.sharding import load_local_state, model_state

    gpt = build_gpt_model(cfg.model, cfg.parallel, vocab_size, device, initialize=not cfg.model.init_from)
    if cfg.model.init_from:
        run_tokenizer = cfg.model.tokenizer or os.path.join(cfg.run.output_dir, "tokenizer")  # embedded: saved there
        load_pretrained(gpt, cfg.model.init_from, cfg.model, run_tokenizer)
    ref_device = torch.device("cpu") if cfg.reference.offload else device
    reference = build_gpt_model(cfg.model, cfg.parallel, vocab_size, device, initialize=False).to(ref_device).eval()
    load_local_state(reference, {k: v.to(ref_device) for k, v in model_state(gpt).items()})
    for p in reference.parameters():
        p.requires_grad_(False)
        if cfg.reference.offload and torch.cuda.is_available():
            p.data = p.data.pin_memory()  # host-to-device copies at full PCIe speed
    ddp = DistributedDataParallel(
        gpt.config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.parallel.distributed_optimizer,
        ),
        gpt,
    )
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = ddp.no_sync
    optimizer = build_optimizer(ddp, cfg.optim, cfg.parallel.distributed_optimizer, cfg.model.params_dtype)
    guard = StepGuard(
        max_skipped=cfg.trainer.max_skipped_steps,
        kl_warn=cfg.trainer.kl_warn,
        lrs={"optim.lr": cfg.optim.lr, "warm_start.lr": cfg.warm_start.lr},
    )
    return Learner(ddp, optimizer, reference, device, reference_offloaded=cfg.reference.offload, guard=guard)


def load_pretrained(gpt, folder: str, model_cfg, run_tokenizer: str | None = None) -> None:
    """Weights from ``model.init_from``: a Hugging Face folder or a nemo-orchestra checkpoint. A
    vocabulary of another size is refused, naming the checkpoint's tokenizer to train with
    (``check_vocab``; ``run_tokenizer``: this run's tokenizer folder, to tell whether it is the same);
    weights holding a NaN or an infinity are refused."""
    from nemo_orchestra.export.qwen3 import (
        HFWeights,
        hf_to_megatron_tensor,
        megatron_names,
        model_config_from_hf,
        read_hf_config,
    )
    from nemo_orchestra.megatron import dist_ckpt
    from nemo_orchestra.megatron.sharding import load_full_state

    if not os.path.isdir(folder):
        raise ValueError(f"model.init_from: no such folder {folder!r}")
    source = source_tokenizer(folder)
    same = same_tokenizer(source, run_tokenizer)
    if dist_ckpt.is_checkpoint(folder):
        dist_ckpt.check_model_config(folder, model_cfg)
        check_vocab(dist_ckpt.read_meta(folder)["vocab_size"], gpt.vocab_size, folder, source, same)
        dist_ckpt.load_model(gpt, folder)
    elif os.path.isfile(os.path.join(folder, "config.json")):
        hf_cfg = read_hf_config(folder)
        check_same_architecture(model_config_from_hf(hf_cfg, model_cfg), model_cfg, folder)
        check_vocab(hf_cfg["vocab_size"], gpt.vocab_size, folder, source, same)
        weights = HFWeights(folder)
        dtype = gpt.config.params_dtype
        load_full_state(
            gpt, lambda n: hf_to_megatron_tensor(n, weights.__getitem__, model_cfg).to(dtype), megatron_names(model_cfg)
        )
    else:
        raise ValueError(f"model.init_from: {folder!r} is neither a Hugging Face folder nor a checkpoint")
    bad = first_non_finite(gpt.named_parameters())
    if any_rank(bad is not None)[0]:
        raise ValueError(
            f"model.init_from={folder}: {bad or 'a weight on another rank'} holds non-finite values (NaN or inf): "
            "it was saved by a run that had diverged; start from an earlier checkpoint"
        )
    log.info("initialized the policy from %s", folder)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def source_tokenizer(folder: str) -> str | None:
    """The tokenizer folder ``model.init_from`` was trained with: its own tokenizer files (a Hugging
    Face folder, an export) or ``tokenizer/`` beside it or in its run folder (a checkpoint
    ``<run>/checkpoints/step_N``); None when there is none."""
    for candidate in (
        folder,
        os.path.join(folder, "tokenizer"),
        os.path.join(folder, os.pardir, os.pardir, "tokenizer"),
    ):
        if any(os.path.isfile(os.path.join(candidate, f)) for f in TOKENIZER_FILES):
            return os.path.normpath(candidate)
    return None


def same_tokenizer(a: str | None, b: str | None) -> bool:
    """Whether two tokenizer folders map tokens to the same ids: one folder, or the same vocabulary
    and added tokens in their ``tokenizer.json``. False when either is unknown or unreadable."""
    if not a or not b:
        return False
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return _token_ids(a) == _token_ids(b)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _token_ids(folder: str):
    with open(os.path.join(folder, "tokenizer.json")) as f:
        spec = json.load(f)
    return spec["model"]["vocab"], sorted((t["id"], t["content"]) for t in spec.get("added_tokens", []))


def build_optimizer(ddp, cfg: OptimConfig, distributed: bool, params_dtype: str, lr: float | None = None):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from nemo_orchestra.megatron.cpu_compat import cuda_type_names

    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=lr or cfg.lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.grad_clip,
        use_distributed_optimizer=distributed,
        bf16=params_dtype == "bf16",
        fp16=params_dtype == "fp16",
        params_dtype=DTYPES[params_dtype],
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
