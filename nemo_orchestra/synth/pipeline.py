"""The synthesis pipeline: candidates -> (LLM paraphrase + pass@k filter) -> records -> files.

Output folder::

    train.jsonl, eval.jsonl   task records (docs/data_and_evaluation.md), split deterministically by id
    corpus/docs.jsonl         the search corpus the lookup questions were drawn from
    manifest.json             counts per split/category/domain, content hash, corpus and database
                              seeds, the service tool config that runs these records, the settings

Everything is deterministic in ``seed`` in programmatic mode; the LLM mode is as deterministic
as its endpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from nemo_orchestra.synth.candidates import DOMAIN_CATEGORY, GENERATORS, Candidate
from nemo_orchestra.synth.records import RecordOptions, content_hash, make_record, split, tool_pool
from tools_env.corpus import build_world, write_corpus
from tools_env.domains import DOMAINS
from tools_env.task import TaskRecord

log = logging.getLogger(__name__)

MODES = ("programmatic", "llm")
DEFAULT_MIX = {"arithmetic": 0.2, "lookup": 0.25, "reasoning": 0.15, DOMAIN_CATEGORY: 0.4}


@dataclass
class LLMOptions:
    base_url: str | None = None  # OpenAI-compatible, up to and including /v1
    model: str | None = None
    api_key_env: str | None = None
    k: int = 4  # pass@k samples per candidate; kept when solved 1..k-1 times
    paraphrase: bool = True  # ask the model to reword each problem (names, numbers, ids must survive)
    oversample: float = 2.5  # candidates drawn per wanted record (filtering drops some)
    temperature: float = 1.0
    max_tokens: int = 512
    max_turns: int = 8
    concurrency: int = 8
    timeout_s: float = 60.0

    def validate(self) -> None:
        if not self.base_url or not self.model:
            raise ValueError("mode=llm needs llm.base_url and llm.model")
        if self.k < 2:
            raise ValueError("llm.k must be >= 2 (pass@k keeps tasks solved between 1 and k-1 times)")
        if self.oversample < 1:
            raise ValueError("llm.oversample must be >= 1")


@dataclass
class SynthConfig:
    output: str = ""
    seed: int = 0
    mode: str = "programmatic"
    num_tasks: int = 1000
    eval_fraction: float = 0.1
    corpus_seed: int = 0  # the search world; 0 is what the tool service builds by default
    db_seeds: int = 2  # domain tasks use databases seeded 0..db_seeds-1 (recorded per task)
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    domains: list[str] = field(default_factory=lambda: sorted(DOMAINS))
    records: RecordOptions = field(default_factory=RecordOptions)
    llm: LLMOptions = field(default_factory=LLMOptions)
    progress: bool = True

    def validate(self) -> "SynthConfig":
        if not self.output:
            raise ValueError("output: no output folder given (output=DIR)")
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, got {self.mode!r}")
        if self.num_tasks < 1:
            raise ValueError("num_tasks: must be >= 1")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError("eval_fraction: must be in [0, 1)")
        if self.db_seeds < 1:
            raise ValueError("db_seeds: must be >= 1")
        for k, v in self.mix.items():
            if k not in GENERATORS:
                raise ValueError(f"mix.{k}: unknown category; choose from {sorted(GENERATORS)}")
            if v < 0:
                raise ValueError(f"mix.{k}: must be >= 0")
        if sum(self.mix.values()) <= 0:
            raise ValueError("mix: weights sum to 0")
        for d in self.domains:
            if d not in DOMAINS:
                raise ValueError(f"domains: unknown domain {d!r}; known: {sorted(DOMAINS)}")
        self.records.validate()
        if self.mode == "llm":
            self.llm.validate()
        return self


def allocate(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Split ``total`` by ``weights`` (largest remainder), in the weights' key order."""
    s = sum(weights.values())
    exact = {k: total * w / s for k, w in weights.items()}
    counts = {k: math.floor(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: (counts[k] - exact[k], k))[: total - sum(counts.values())]:
        counts[k] += 1
    return counts


def generate_candidates(cfg: SynthConfig, counts: dict[str, int]) -> list[Candidate]:
    """``counts[category]`` distinct candidates per category (fewer, with a warning, if a generator runs dry)."""
    world = build_world(cfg.corpus_seed)
    out: list[Candidate] = []
    seen: set[str] = set()
    bar = tqdm(total=sum(counts.values()), desc="candidates", disable=not cfg.progress)
    for category, want in counts.items():
        rng = random.Random(f"synth:{cfg.seed}:{category}")
        got, attempts = 0, 0
        while got < want and attempts < 50 * want + 100:
            attempts += 1
            if category == "lookup":
                c = GENERATORS[category](rng, world)
            elif category == DOMAIN_CATEGORY:
                c = GENERATORS[category](rng, cfg.domains[attempts % len(cfg.domains)], rng.randrange(cfg.db_seeds))
            else:
                c = GENERATORS[category](rng)
            if c is None or c.key() in seen:
                continue
            seen.add(c.key())
            out.append(c)
            got += 1
            bar.update(1)
        if got < want:
            log.warning("category %s: only %d distinct candidates of %d wanted", category, got, want)
    bar.close()
    return out


def build_records(cfg: SynthConfig, candidates: list[Candidate]) -> list[TaskRecord]:
    pool = tool_pool()
    return [make_record(c, random.Random(f"record:{cfg.seed}:{c.key()}"), cfg.records, pool) for c in candidates]


def synthesize(cfg: SynthConfig) -> dict:
    """Generate, filter and write the data set; returns the manifest."""
    cfg.validate()
    counts = allocate(cfg.num_tasks, cfg.mix)
    stats: dict = {}
    if cfg.mode == "llm":
        from nemo_orchestra.synth.llm import filter_with_llm

        over = {k: math.ceil(v * cfg.llm.oversample) for k, v in counts.items()}
        candidates, stats = filter_with_llm(cfg, generate_candidates(cfg, over))
        by_cat: dict[str, list[Candidate]] = {}
        for c in candidates:
            by_cat.setdefault(c.category, []).append(c)
        candidates = [c for k, n in counts.items() for c in by_cat.get(k, [])[:n]]
        short = {k: n - len(by_cat.get(k, [])) for k, n in counts.items() if len(by_cat.get(k, [])) < n}
        if short:
            log.warning("pass@k kept too few candidates; missing per category: %s (raise llm.oversample)", short)
    else:
        candidates = generate_candidates(cfg, counts)
    records = build_records(cfg, candidates)
    train, eval_ = split(records, cfg.eval_fraction)
    return write_output(cfg, train, eval_, stats)


def _count(records: list[TaskRecord], key) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[key(r)] = out.get(key(r), 0) + 1
    return dict(sorted(out.items()))


def _sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_output(cfg: SynthConfig, train: list[TaskRecord], eval_: list[TaskRecord], stats: dict) -> dict:
    os.makedirs(cfg.output, exist_ok=True)
    files = {}
    for name, recs in (("train.jsonl", train), ("eval.jsonl", eval_)):
        path = os.path.join(cfg.output, name)
        with open(path, "w") as f:
            for r in recs:
                f.write(r.to_json() + "\n")
        files[name] = _sha256_file(path)
    corpus_path = write_corpus(os.path.join(cfg.output, "corpus"), cfg.corpus_seed)
    files["corpus/docs.jsonl"] = _sha256_file(corpus_path)
    every = train + eval_
    db_seeds = sorted({int(r.verifier.get("db_seed", 0)) for r in every if r.domain})
    manifest = {
        "format": "nemo-orchestra tasks v1",
        "content_hash": content_hash(every),
        "counts": {
            "train": len(train),
            "eval": len(eval_),
            "total": len(every),
            "by_category": _count(every, lambda r: r.category),
            "by_domain": _count([r for r in every if r.domain], lambda r: r.domain),
            "eval_by_category": _count(eval_, lambda r: r.category),
        },
        "corpus": {"path": "corpus", "seed": cfg.corpus_seed, "num_docs": sum(1 for _ in open(corpus_path))},
        "domains": {"names": sorted({r.domain for r in every if r.domain}), "db_seeds": db_seeds},
        "service_tools": {"search": {"corpus": "corpus"}},  # relative to this folder
        "files": files,
        "filter": stats,
        "config": _config_dict(cfg),
    }
    with open(os.path.join(cfg.output, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
    return manifest


def _config_dict(cfg: SynthConfig) -> dict:
    d = asdict(cfg)
    d["records"]["expert_prices"] = {k: list(v) for k, v in d["records"]["expert_prices"].items()}
    d.pop("progress")
    return d
