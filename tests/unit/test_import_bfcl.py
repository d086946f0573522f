"""recipes/import_bfcl.py: one record per BFCL entry (tools, turns, ground truth) and a manifest."""

from __future__ import annotations

import hashlib
import json
import math
import os
import runpy

import pytest

pytest.importorskip("bfcl_eval", reason="BFCL tasks need the 'bfcl' extra")

from tools_env.domains.bfcl.apis import function_classes
from tools_env.task import load_jsonl

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "import_bfcl.py")


def _main():
    return runpy.run_path(RECIPE)["main"]


def test_import_writes_records_and_manifest(tmp_path, capsys):
    assert _main()([f"output={tmp_path}", "categories=multi_turn_base,multi_turn_miss_param", "limit=3"]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["source"]["version"] == "2026.3.23"
    assert manifest["counts"]["by_category"] == {"multi_turn_base": 3, "multi_turn_miss_param": 3}
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == digest
    records = load_jsonl(str(tmp_path / "multi_turn_base.jsonl"))
    for r in records + load_jsonl(str(tmp_path / "multi_turn_miss_param.jsonl")):
        entry = r.meta["bfcl"]
        oracle = len(r.gold_actions) + 1  # the oracle replays the gold actions, then answers the last turn
        assert oracle == sum(len(t) for t in entry["ground_truth"]) + len(entry["turns"])
        assert r.max_turns == math.ceil(1.5 * oracle) > oracle, (r.id, r.max_turns, oracle)
    assert [r.max_turns for r in records] == [21, 15, 20]  # 14, 10 and 13 oracle turns
    assert [r.id for r in records] == ["bfcl-multi_turn_base_0", "bfcl-multi_turn_base_1", "bfcl-multi_turn_base_2"]
    owners = function_classes()
    for r in records:
        entry = r.meta["bfcl"]
        assert r.verifier == {"type": "bfcl"} and r.domain == "bfcl" and r.tools[-1] == "answer"
        assert {owners[t] for t in r.tools[:-1]} == set(entry["involved_classes"])
        assert r.problem.startswith(entry["turns"][0])
        calls = [a for a in r.gold_actions if a["name"] != "answer"]
        assert len(calls) == sum(len(t) for t in entry["ground_truth"])  # every ground-truth call, by keyword
        assert len(r.gold_actions) - len(calls) == len(entry["turns"]) - 1  # an answer ends each turn but the last
    first = records[0]
    assert "cp" not in first.tools  # the entry's excluded_function
    assert {"name": "sort", "arguments": {"file_name": "final_report.pdf"}} in first.gold_actions  # sort('...') named
    assert not first.meta["bfcl"]["long_context"]


def test_refused_and_unknown_categories_are_one_line_errors(tmp_path, capsys):
    assert _main()([f"output={tmp_path}", "categories=multi_turn_miss_func"]) == 2
    assert "multi_turn_miss_func is not supported" in capsys.readouterr().err
    assert _main()([f"output={tmp_path}", "categories=simple_python"]) == 2
    assert "unknown 'simple_python'" in capsys.readouterr().err
    assert not os.listdir(tmp_path)
