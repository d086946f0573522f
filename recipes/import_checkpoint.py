"""Turn a local Hugging Face Qwen3 (or Llama) folder into a checkpoint the trainer starts from.

The output is Megatron-Core's distributed checkpoint format (tensors stored by global name and
offset, so it loads under any TP/PP/DP layout) plus ``nemo_orchestra.json`` (the model config)
and the folder's tokenizer files. ``parallel.tp``/``parallel.pp`` shard the import itself:
under torchrun each rank reads and converts only its slice. Weights keep the folder's dtype
unless ``dtype=fp32|bf16|fp16`` says otherwise. Llama has no QK-norm: the model it describes
has ``model.qk_norm=false``.

Launch:
    python recipes/import_checkpoint.py hf=/models/Qwen3-8B output=checkpoints/qwen3-8b
    torchrun --nproc-per-node 2 recipes/import_checkpoint.py hf=/models/Qwen3-8B output=checkpoints/qwen3-8b \
        parallel.tp=2
    python recipes/grpo_orchestrator.py model=qwen3_8b model.init_from=checkpoints/qwen3-8b \\
        model.tokenizer=checkpoints/qwen3-8b
"""

import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Optional

from nemo_orchestra.config import PARAMS_DTYPES, ConfigError, load_recipe_config
from nemo_orchestra.config_help import recipe_help, wants_help
from nemo_orchestra.runtime.console import setup_logging


@dataclass
class ImportArgs:
    hf: str = ""  # the Hugging Face Qwen3 (or Llama) folder
    output: str = ""  # the Megatron checkpoint to write
    dtype: Optional[str] = None  # fp32 | bf16 | fp16; default: the folder's

    def validate(self) -> None:
        if not self.hf or not self.output:
            raise ValueError("usage: import_checkpoint.py hf=DIR output=DIR [dtype=bf16] [parallel.tp=N parallel.pp=M]")
        if self.dtype is not None and self.dtype not in PARAMS_DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(PARAMS_DTYPES)}, got {self.dtype!r}")


def main(argv: list[str]) -> int:
    try:
        if wants_help(argv):
            print(recipe_help(__doc__, ImportArgs, main=True, argv=argv), end="")
            return 0
        args, cfg = load_recipe_config(ImportArgs, argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.run.log_level, int(os.environ.get("RANK", 0)))  # before Megatron is imported

    from nemo_orchestra.export.convert import import_hf
    from nemo_orchestra.megatron.parallel import destroy_distributed, init_distributed

    info = init_distributed(cfg.parallel, cfg.run.seed)
    model = import_hf(args.hf, args.output, cfg.model, cfg.parallel, info.device, args.dtype)
    if info.is_main:
        logging.getLogger("import_checkpoint").info(
            "wrote %s: %s",
            args.output,
            json.dumps(
                {
                    k: getattr(model, k)
                    for k in (
                        "vocab_size",
                        "hidden_size",
                        "num_layers",
                        "num_attention_heads",
                        "num_query_groups",
                        "qk_norm",
                        "tie_embeddings",
                        "params_dtype",
                    )
                }
            ),
        )
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
