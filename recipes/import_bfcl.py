"""Import BFCL v4 multi-turn entries as task records for training and evaluation.

Reads the data shipped in the ``bfcl-eval`` package (install the ``bfcl`` extra:
``EXTRAS=test,bfcl bash scripts/setup.sh``) and writes ``OUTPUT/<category>.jsonl`` (one record per
entry, docs/data_and_evaluation.md, "BFCL") and ``OUTPUT/manifest.json`` (source version, counts, file hashes,
content hash). The tool service runs the records with BFCL's API classes and checks them with our
implementation of BFCL's multi-turn checker (``tools_env/domains/bfcl``).

Launch:
    python recipes/import_bfcl.py output=data/bfcl categories=multi_turn_base
    python recipes/evaluate.py tasks=data/bfcl/multi_turn_base.jsonl output=runs/bfcl_oracle \
        policies=oracle
Keys: output, categories (multi_turn_base, multi_turn_long_context, multi_turn_miss_param),
limit (entries per category; 0: all). ``--help`` lists them with their defaults.
"""

import json
import sys
from dataclasses import dataclass, field
from typing import List

from nemo_orchestra.config import ConfigError, load_structured
from nemo_orchestra.config_help import recipe_help, wants_help


@dataclass
class ImportConfig:
    output: str = ""
    categories: List[str] = field(default_factory=lambda: ["multi_turn_base"])
    limit: int = 0

    def validate(self) -> None:
        if not self.output:
            raise ValueError("output: required (the folder to write the task files into)")
        if self.limit < 0:
            raise ValueError("limit: must be >= 0")
        from tools_env.domains.bfcl.importer import check_categories

        check_categories(self.categories)


def main(argv: list) -> int:
    if wants_help(argv):
        print(recipe_help(__doc__, ImportConfig), end="")
        return 0
    from tools_env.domains.bfcl.package import BfclUnavailable

    try:
        cfg = load_structured(ImportConfig, argv)
        from tools_env.domains.bfcl.importer import import_categories

        manifest = import_categories(cfg.output, cfg.categories, cfg.limit)
    except (ConfigError, ValueError, BfclUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"output": cfg.output, "content_hash": manifest["content_hash"], **manifest["counts"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
