"""Programmatic task synthesis: determinism, content hash, split, record randomization, CLI, loader errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nemo_orchestra.synth.candidates import _digit_sum_count, _divisors, _prime_sum, _stairs, arithmetic
from nemo_orchestra.config import ConfigError, load_structured
from nemo_orchestra.synth.pipeline import SynthConfig, allocate, synthesize
from tools_env.domains import DOMAINS
from tools_env.task import TaskRecordError, load_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _make(tmp_path, name, **kw):
    cfg = SynthConfig(output=str(tmp_path / name), num_tasks=kw.pop("num_tasks", 150), progress=False, **kw)
    return synthesize(cfg), cfg.output


def test_same_seed_same_hash_other_seed_other_hash(tmp_path):
    a, _ = _make(tmp_path, "a", seed=7)
    b, _ = _make(tmp_path, "b", seed=7)
    c, _ = _make(tmp_path, "c", seed=8)
    assert a["content_hash"] == b["content_hash"] and a["files"] == b["files"]
    assert a["content_hash"] != c["content_hash"]


def test_manifest_counts_and_files(tmp_path):
    m, out = _make(tmp_path, "m", seed=1, num_tasks=200, eval_fraction=0.25)
    train, eval_ = load_jsonl(os.path.join(out, "train.jsonl")), load_jsonl(os.path.join(out, "eval.jsonl"))
    assert (len(train), len(eval_)) == (150, 50) == (m["counts"]["train"], m["counts"]["eval"])
    assert m["counts"]["by_category"] == {"arithmetic": 40, "function_calling": 80, "lookup": 50, "reasoning": 30}
    assert sum(m["counts"]["by_domain"].values()) == 80 and set(m["counts"]["by_domain"]) == set(DOMAINS)
    assert not {r.id for r in train} & {r.id for r in eval_}
    assert os.path.exists(os.path.join(out, "corpus", "docs.jsonl")) and m["corpus"]["num_docs"] > 100
    assert m["domains"]["db_seeds"] == [0, 1]


def test_records_offer_needed_tools_distractors_prices_and_preferences(tmp_path):
    _, out = _make(tmp_path, "r", seed=2)
    records = load_jsonl(os.path.join(out, "train.jsonl"))
    aliases = {"expert-small", "expert-medium", "expert-large"}
    for r in records:
        assert "answer" in r.tools and len(set(r.tools)) == len(r.tools)
        if r.category == "lookup":
            assert {"search", "expert"} <= set(r.tools)
        if r.domain:
            assert {f"{r.domain}_{f}" for f in DOMAINS[r.domain].functions} <= set(r.tools)
            assert r.verifier["type"] == "db_state" and r.gold_actions
        assert set(r.prices) == aliases
        assert set(r.preference) == {"accuracy", "cost", "latency", "tools"}
        assert set(r.preference["tools"]) <= set(r.tools)
    # randomized per record: tool sets, sizes and prices differ
    assert len({len(r.tools) for r in records if r.category == "arithmetic"}) > 1
    assert len({r.prices["expert-large"]["output"] for r in records}) > 10


def test_split_is_deterministic_and_independent_of_record_order(tmp_path):
    from nemo_orchestra.synth.records import split

    _, out = _make(tmp_path, "s", seed=3)
    records = load_jsonl(os.path.join(out, "train.jsonl")) + load_jsonl(os.path.join(out, "eval.jsonl"))
    _, e1 = split(records, 0.1)
    _, e2 = split(list(reversed(records)), 0.1)
    assert {r.id for r in e1} == {r.id for r in e2} and len(e1) == 15


def test_allocate_largest_remainder():
    assert allocate(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}
    assert sum(allocate(7, {"a": 0.2, "b": 0.25, "c": 0.15, "d": 0.4}).values()) == 7


def test_hard_question_solvers_against_brute_force():
    assert _digit_sum_count(1000, 3) == sum(1 for n in range(1, 1001) if sum(map(int, str(n))) == 3)
    assert _prime_sum(30) == 2 + 3 + 5 + 7 + 11 + 13 + 17 + 19 + 23 + 29
    assert _stairs(4) == 7  # 1111 112 121 211 22 13 31
    assert _divisors([(2, 2), (3, 1)]) == (12, 6)


def test_arithmetic_answer_is_the_expression_value():
    import random

    rng = random.Random(0)
    for _ in range(50):
        c = arithmetic(rng)
        assert str(eval(c.meta["expression"])) == c.answer  # our own generated text: digits, + - * ( )


def test_malformed_record_is_rejected_with_line_number_and_reason(tmp_path):
    _, out = _make(tmp_path, "bad", seed=4, num_tasks=20)
    lines = open(os.path.join(out, "train.jsonl")).read().splitlines()
    broken = json.loads(lines[2])
    del broken["answer"]
    lines[2] = json.dumps(broken)
    lines[4] = lines[4][:-5]
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(lines[:4]) + "\n")
    with pytest.raises(TaskRecordError, match=r"broken.jsonl:3: task record is missing 'answer'"):
        load_jsonl(str(path))
    path.write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    with pytest.raises(TaskRecordError, match=r"broken.jsonl:4: not valid JSON"):
        load_jsonl(str(path))


def test_overrides_reach_nested_keys_and_reject_unknown_ones():
    cfg = load_structured(
        SynthConfig, ["output=x", "seed=3", "mix.lookup=0.5", "llm.k=6", "domains=bank,movie", "records.price_jitter=0"]
    )
    assert (cfg.seed, cfg.mix["lookup"], cfg.llm.k, cfg.domains, cfg.records.price_jitter) == (
        3,
        0.5,
        6,
        ["bank", "movie"],
        0.0,
    )
    assert isinstance(cfg, SynthConfig) and isinstance(cfg.records.price_jitter, float)
    with pytest.raises(ConfigError, match="llm.kk: unknown config key; valid keys under llm: .*base_url"):
        load_structured(SynthConfig, ["output=x", "llm.kk=1"])
    with pytest.raises(ConfigError, match="num_tasks"):
        load_structured(SynthConfig, ["output=x", "num_tasks=many"])
    with pytest.raises(ConfigError, match="mix.riddles: unknown category"):  # the dataclass's validate() runs
        load_structured(SynthConfig, ["output=x", "mix.riddles=0.5"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_structured(SynthConfig, ["output"])


def test_cli_unknown_key_exits_nonzero_naming_it(tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "recipes", "synthesize_data.py"), f"output={tmp_path}", "sede=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode != 0 and "sede: unknown config key" in proc.stderr
