"""BFCL multi-turn entries as task records (``recipes/import_bfcl.py``).

One record per entry of a category file ``data/BFCL_v4_<category>.json``, with its ground truth
from ``data/possible_answer/``:

- ``tools``: the function names of the entry's involved classes (their BFCL function docs are
  the schemas the service shows), less the entry's ``excluded_function``, plus ``answer``;
- ``problem``: the first user turn and how turns work here; the later user turns, the initial
  configuration and BFCL's ground-truth call strings sit in ``meta["bfcl"]``;
- ``gold_actions``: the ground truth as the policy would call it (positional arguments named
  from the method's signature), with an ``answer`` ending each turn but the last (the oracle
  adds the final one);
- ``max_turns``: the entry's turn budget (``turn_budget``).

``multi_turn_miss_func`` is refused: its entries add functions to the tool set in the middle of
an episode, which an episode's fixed tool set cannot express. Single-turn categories are not
multi-turn tasks and are refused too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

from tools_env.domains.bfcl.apis import CLASSES, call_as_action, data_dir, function_classes, function_docs, parse_call
from tools_env.domains.bfcl.package import BFCL_VERSION, require_bfcl
from tools_env.task import TaskRecord

CATEGORIES = ("multi_turn_base", "multi_turn_long_context", "multi_turn_miss_param")
REFUSED = {
    "multi_turn_miss_func": "its entries add functions to the tool set in the middle of an episode; an "
    "episode's tool set is fixed when it is created",
}
TURN_NOTE = (
    "This is turn 1 of {n}. Use the tools to do what is asked, then call `answer` with a short "
    "reply to end the turn; the user's next request, if any, comes back as the result of that call."
)


# the turn budget's margin over the oracle's turns, for a model's extra calls (a look around, a retry)
BUDGET_FACTOR = 1.5


def turn_budget(ground_truth: list[list[str]]) -> int:
    """An entry's turn budget: its ground-truth calls plus one ``answer`` per user turn (the turns the
    oracle takes), times ``BUDGET_FACTOR``, rounded up."""
    return math.ceil(BUDGET_FACTOR * (sum(len(calls) for calls in ground_truth) + len(ground_truth)))


def check_categories(categories: list[str]) -> None:
    for c in categories:
        if c in REFUSED:
            raise ValueError(f"categories: {c} is not supported: {REFUSED[c]}")
        if c not in CATEGORIES:
            raise ValueError(f"categories: unknown {c!r}; multi-turn categories: {', '.join(CATEGORIES)}")


def read_category(category: str) -> list[tuple[dict[str, Any], list[list[str]]]]:
    """The entries of a category with their ground truth, matched by id."""
    base = data_dir()
    entries = _read_jsonl(os.path.join(base, f"BFCL_v4_{category}.json"))
    answers = _read_jsonl(os.path.join(base, "possible_answer", f"BFCL_v4_{category}.json"))
    truth = {e["id"]: e["ground_truth"] for e in answers}
    missing = [e["id"] for e in entries if e["id"] not in truth]
    if missing:
        raise ValueError(f"{category}: no ground truth for {len(missing)} entries (first: {missing[0]})")
    return [(e, truth[e["id"]]) for e in entries]


def to_record(entry: dict[str, Any], ground_truth: list[list[str]], category: str) -> TaskRecord:
    turns = ["\n".join(m["content"] for m in turn if m.get("role") == "user") for turn in entry["question"]]
    if len(turns) != len(ground_truth):
        raise ValueError(f"{entry['id']}: {len(turns)} user turns but {len(ground_truth)} ground-truth turns")
    unknown = [c for c in entry["involved_classes"] if c not in CLASSES]
    if unknown:
        raise ValueError(f"{entry['id']}: involves {unknown}, not a multi-turn API class")
    excluded = set(entry.get("excluded_function", []))
    tools = [d["name"] for c in entry["involved_classes"] for d in function_docs(c) if d["name"] not in excluded]
    owners = function_classes()
    gold: list[dict[str, Any]] = []
    for k, calls in enumerate(ground_truth):
        for call in calls:
            name = parse_call(call)[0]
            if name not in tools or owners[name] not in entry["involved_classes"]:
                raise ValueError(f"{entry['id']}: ground truth calls {name!r}, not among the entry's functions")
            gold.append(call_as_action(call))
        if k + 1 < len(ground_truth):
            gold.append({"name": "answer", "arguments": {"answer": "done"}})
    meta = {
        "bfcl": {
            "id": entry["id"],
            "category": category,
            "version": BFCL_VERSION,
            "involved_classes": list(entry["involved_classes"]),
            "initial_config": entry["initial_config"],
            "long_context": "long_context" in category,
            "turns": turns,
            "ground_truth": ground_truth,
        }
    }
    return TaskRecord(
        problem=f"{turns[0]}\n\n{TURN_NOTE.format(n=len(turns))}",
        answer="",
        category="function_calling",
        tools=tools + ["answer"],
        id=f"bfcl-{entry['id']}",
        verifier={"type": "bfcl"},
        domain="bfcl",
        gold_actions=gold,
        max_turns=turn_budget(ground_truth),
        meta=meta,
    )


def import_categories(output: str, categories: list[str], limit: int = 0) -> dict[str, Any]:
    """Write ``<output>/<category>.jsonl`` for each category and ``manifest.json``; returns the manifest."""
    check_categories(categories)
    require_bfcl()
    os.makedirs(output, exist_ok=True)
    files, counts, every = {}, {}, []
    for category in categories:
        pairs = read_category(category)
        records = [to_record(e, gt, category) for e, gt in (pairs[:limit] if limit else pairs)]
        path = os.path.join(output, f"{category}.jsonl")
        with open(path, "w") as f:
            for r in records:
                f.write(r.to_json() + "\n")
        files[f"{category}.jsonl"] = _sha256(path)
        counts[category] = len(records)
        every += records
    manifest = {
        "format": "nemo-orchestra tasks v1",
        "source": {
            "package": "bfcl-eval",
            "version": BFCL_VERSION,
            "benchmark": "BFCL v4 multi-turn",
            "license": "Apache-2.0",
        },
        "content_hash": _content_hash(every),
        "counts": {
            "total": len(every),
            "by_category": counts,
            "user_turns": sum(len(r.meta["bfcl"]["turns"]) for r in every),
            "ground_truth_calls": sum(len(t) for r in every for t in r.meta["bfcl"]["ground_truth"]),
        },
        "classes": sorted({c for r in every for c in r.meta["bfcl"]["involved_classes"]}),
        "files": files,
        "service_tools": {},
        "config": {"categories": list(categories), "limit": limit},
    }
    with open(os.path.join(output, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
    return manifest


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _content_hash(records: list[TaskRecord]) -> str:
    h = hashlib.sha256()
    for line in sorted(r.to_json() for r in records):
        h.update(line.encode() + b"\n")
    return h.hexdigest()
