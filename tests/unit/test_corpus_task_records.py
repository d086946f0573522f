"""A search corpus never serves a task record: a file of tasks given as the corpus is refused."""

from __future__ import annotations

import json

import pytest

from tools_env.corpus import load_corpus


def test_a_task_record_in_the_corpus_is_refused(tmp_path):
    path = tmp_path / "docs.jsonl"
    docs = [{"id": "d1", "title": "A", "text": "a fact"}, {"id": "t1", "text": "What?", "answer": "secret"}]
    path.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    with pytest.raises(ValueError, match=r"docs.jsonl:2: a task record \(answer\), not a corpus document"):
        load_corpus(str(path))


def test_documents_load(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"id": "d1", "title": "A", "text": "a fact"}) + "\n")
    assert [d.id for d in load_corpus(str(path))] == ["d1"]
