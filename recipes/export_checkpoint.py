"""Write a Hugging Face folder from a nemo-orchestra checkpoint saved under any TP/PP layout.

The checkpoint is a training checkpoint (``<run>/checkpoints/step_N``) or an import. Megatron
reshards its tensors into the layout of this run (one process by default; ``parallel.tp/pp``
under torchrun), the shards are gathered to full weights, and rank 0 writes ``config.json``,
``generation_config.json``, safetensors (2 GB shards with an index when larger) and the
tokenizer files (from ``tokenizer=DIR``, the checkpoint folder, or the run's ``tokenizer/``).
``dtype=`` picks the weights' dtype (default: the model's).

``format=trtllm tp=N`` writes a TensorRT-LLM checkpoint instead (``config.json`` with its
``mapping`` and ``rank{i}.safetensors``, fused QKV, sharded for tensor parallelism N; layout in
``nemo_orchestra/export/trtllm.py``) for ``trtllm-build --checkpoint_dir OUTPUT --output_dir ENGINE``.

Launch:
    python recipes/export_checkpoint.py checkpoint=runs/grpo_orchestrator/checkpoints/step_00000008 output=runs/hf
    python recipes/export_checkpoint.py checkpoint=checkpoints/qwen3-8b output=/models/qwen3-8b-roundtrip dtype=bf16
    python recipes/export_checkpoint.py checkpoint=checkpoints/qwen3-8b output=/models/qwen3-8b-trtllm-tp2 \
        format=trtllm tp=2 dtype=bf16
"""

import logging
import os
import sys
from dataclasses import dataclass
from typing import Optional

from nemo_orchestra.config import PARAMS_DTYPES, ConfigError, load_recipe_config
from nemo_orchestra.config_help import recipe_help, wants_help
from nemo_orchestra.runtime.console import setup_logging


@dataclass
class ExportArgs:
    checkpoint: str = ""  # a training checkpoint (<run>/checkpoints/step_N) or an import
    output: str = ""  # the Hugging Face folder to write
    tokenizer: Optional[str] = None  # default: the checkpoint folder's or the run's tokenizer/
    dtype: Optional[str] = None  # fp32 | bf16 | fp16; default: the model's
    format: str = "hf"  # hf: a Hugging Face folder | trtllm: a TensorRT-LLM checkpoint
    tp: int = 1  # format=trtllm: tensor-parallel ranks the checkpoint is sharded for

    def validate(self) -> None:
        if not self.checkpoint or not self.output:
            raise ValueError(
                "usage: export_checkpoint.py checkpoint=DIR output=DIR [tokenizer=DIR] [dtype=bf16] "
                "[format=hf|trtllm] [tp=N]"
            )
        if self.dtype is not None and self.dtype not in PARAMS_DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(PARAMS_DTYPES)}, got {self.dtype!r}")
        if self.format not in ("hf", "trtllm"):
            raise ValueError(f"format: must be hf or trtllm, got {self.format!r}")
        if self.tp < 1 or (self.tp != 1 and self.format != "trtllm"):
            raise ValueError(f"tp: must be >= 1 and is for format=trtllm only, got tp={self.tp} format={self.format}")


def main(argv: list[str]) -> int:
    try:
        if wants_help(argv):
            print(recipe_help(__doc__, ExportArgs, main=True, argv=argv), end="")
            return 0
        args, cfg = load_recipe_config(ExportArgs, argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.run.log_level, int(os.environ.get("RANK", 0)))  # before Megatron is imported

    from nemo_orchestra.export.convert import export_checkpoint
    from nemo_orchestra.megatron.parallel import destroy_distributed, init_distributed

    info = init_distributed(cfg.parallel, cfg.run.seed)
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.output,
            cfg.parallel,
            info.device,
            args.tokenizer,
            args.dtype,
            fmt=args.format,
            tp_out=args.tp,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if info.is_main:
        what = "TensorRT-LLM checkpoint" if args.format == "trtllm" else "Hugging Face folder"
        logging.getLogger("export_checkpoint").info("wrote %s %s", what, out)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
