"""LLM-driven synthesis against a fake OpenAI-compatible server on loopback: rewording and pass@k."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from nemo_orchestra.synth.llm import accept_rewording, protected_tokens
from nemo_orchestra.synth.pipeline import LLMOptions, SynthConfig, allocate, generate_candidates, synthesize
from tools_env.task import load_jsonl
from tests.doubles import ORACLE_CHAT_SERVER


def test_protected_tokens_must_survive_a_rewording():
    text = "I'm Sven Ueda. Send 120.50 dollars from ACC-03C to ACC-15S on 2025-06-02 for 'Paper Moons'."
    assert {"Sven Ueda", "120.50", "ACC-03C", "ACC-15S", "2025-06-02", "'Paper Moons'"} <= protected_tokens(text)
    assert accept_rewording(
        text, "Hi, Sven Ueda here: please move 120.50 dollars from ACC-03C to ACC-15S on 2025-06-02 for 'Paper Moons'."
    )
    assert not accept_rewording(text, "Sven Ueda wants 120.5 dollars moved from ACC-03C to ACC-15S on 2025-06-02.")
    assert not accept_rewording(text, "")


@pytest.fixture()
def fake_llm(tmp_path):
    """A fake server whose oracle knows the candidates the test config will draw."""
    cfg = SynthConfig(
        output=str(tmp_path / "out"),
        seed=11,
        num_tasks=20,
        mode="llm",
        progress=False,
        llm=LLMOptions(base_url="unset", model="fake", k=3, oversample=3.0, concurrency=16),
    )
    counts = {k: math.ceil(v * cfg.llm.oversample) for k, v in allocate(cfg.num_tasks, cfg.mix).items()}
    oracle = tmp_path / "oracle.jsonl"
    with open(oracle, "w") as f:
        for c in generate_candidates(cfg, counts):
            f.write(
                json.dumps(
                    {"key": c.meta.get("scenario", c.problem), "answer": c.answer, "gold_actions": c.gold_actions}
                )
                + "\n"
            )
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, ORACLE_CHAT_SERVER, "--oracle", str(oracle), "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    cfg.llm.base_url = ready.read_text()
    yield cfg
    proc.terminate()
    proc.wait(5)


def test_llm_mode_keeps_what_is_solved_between_1_and_k_minus_1_times(fake_llm):
    cfg = fake_llm
    m = synthesize(cfg)
    f = m["filter"]
    hist = {int(k): v for k, v in f["solved_histogram"].items()}
    assert f["candidates"] == sum(hist.values()) and hist.get(0) and hist.get(3)  # both extremes dropped
    assert f["kept"] == hist.get(1, 0) + hist.get(2, 0)
    assert f["paraphrased"] == f["candidates"]
    records = load_jsonl(os.path.join(cfg.output, "train.jsonl")) + load_jsonl(os.path.join(cfg.output, "eval.jsonl"))
    assert 0 < len(records) <= cfg.num_tasks
    assert {r.category for r in records} == {"arithmetic", "lookup", "reasoning", "function_calling"}
    for r in records:
        assert 1 <= r.meta["pass_at_k"]["solved"] <= 2
        assert r.problem.count("Please help with this:") == 1  # the fake model's rewording was accepted
