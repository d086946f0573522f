"""Synthesize ToolScale-style task data: QA and domain tasks with verifiable ground truth.

Writes train.jsonl, eval.jsonl (task records, docs/data_and_evaluation.md), the search corpus the lookup
questions need (corpus/docs.jsonl) and manifest.json (counts, content hash, corpus and
database seeds). Domain databases are not written: they are rebuilt from their seed, which
every domain record carries in ``verifier.db_seed``.

Modes:
- programmatic (default): deterministic and offline; answers and final database states come
  from executing the generators and gold actions.
- llm: programmatic candidates, reworded by an OpenAI-compatible model (names, numbers and ids
  must survive the rewording), then filtered by pass@k: the model solves each candidate k times
  as a policy through the tool service, and candidates solved between 1 and k-1 times are kept.

Launch:
    python recipes/synthesize_data.py output=data/toolscale seed=0
    python recipes/synthesize_data.py output=data/small seed=1 num_tasks=200 mix.lookup=0.5
    python recipes/synthesize_data.py output=data/llm mode=llm llm.base_url=http://127.0.0.1:8000/v1 \
        llm.model=Qwen3-32B llm.k=4 num_tasks=500
``--help`` lists every key with its default.
"""

import json
import sys

from nemo_orchestra.config import ConfigError, load_structured
from nemo_orchestra.config_help import recipe_help, wants_help
from nemo_orchestra.synth import SynthConfig, synthesize
from nemo_orchestra.runtime.console import setup_logging


def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(recipe_help(__doc__, SynthConfig), end="")
        return 0
    setup_logging("INFO", 0)
    try:
        cfg = load_structured(SynthConfig, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    manifest = synthesize(cfg)
    print(json.dumps({"output": cfg.output, "content_hash": manifest["content_hash"], **manifest["counts"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
