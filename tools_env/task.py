"""The task record: one line of a task jsonl file, and what an episode is created from.

A minimal QA record is ``{"problem": str, "answer": str, "category": str, "tools": [names]}``.
Optional fields:

- ``id``: a stable identifier (defaults to a hash of the problem).
- ``prices``: ``{alias: {"input": $/1M tokens, "output": $/1M tokens}}`` overriding the
  service's configured prices for expert aliases in this episode.
- ``preference``: ``{"accuracy": w, "cost": w, "latency": w, "tools": {tool: w}}`` — the
  user preference vector the composite reward applies (weights >= 0).
- ``verifier``: ``{"type": "exact" | "numeric" | "db_state" | "judge", ...}``; default exact.
- ``domain``: ToolScale-style domain name, with ``gold_actions`` for database-state tasks.
- ``meta``: free-form, carried through untouched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

VERIFIER_TYPES = ("exact", "numeric", "db_state", "judge")


class TaskRecordError(ValueError):
    """A task record that does not follow the schema; the message names the field."""


@dataclass
class TaskRecord:
    problem: str
    answer: str
    category: str
    tools: list[str]
    id: str = ""
    prices: dict[str, dict[str, float]] = field(default_factory=dict)
    preference: dict[str, Any] = field(default_factory=dict)
    verifier: dict[str, Any] = field(default_factory=lambda: {"type": "exact"})
    domain: str | None = None
    gold_actions: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = hashlib.sha1(self.problem.encode()).hexdigest()[:12]

    @classmethod
    def from_dict(cls, d: Any) -> "TaskRecord":
        if not isinstance(d, dict):
            raise TaskRecordError(f"task record must be a JSON object, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise TaskRecordError(f"unknown task record field(s): {', '.join(unknown)}")
        for key, typ in (("problem", str), ("answer", str), ("category", str)):
            if key not in d:
                raise TaskRecordError(f"task record is missing '{key}'")
            if not isinstance(d[key], typ):
                raise TaskRecordError(f"task record field '{key}' must be a string")
        if "tools" not in d:
            raise TaskRecordError("task record is missing 'tools'")
        if not isinstance(d["tools"], list) or not all(isinstance(t, str) for t in d["tools"]):
            raise TaskRecordError("task record field 'tools' must be a list of tool names")
        prices = d.get("prices", {})
        if not isinstance(prices, dict):
            raise TaskRecordError("task record field 'prices' must be an object")
        for alias, p in prices.items():
            if not isinstance(p, dict) or set(p) - {"input", "output"}:
                raise TaskRecordError(f"prices['{alias}'] must be {{'input': $/1M, 'output': $/1M}}")
            for k, v in p.items():
                if not isinstance(v, (int, float)) or v < 0:
                    raise TaskRecordError(f"prices['{alias}']['{k}'] must be a number >= 0")
        pref = d.get("preference", {})
        if not isinstance(pref, dict):
            raise TaskRecordError("task record field 'preference' must be an object")
        for k, v in pref.items():
            if k == "tools":
                if not isinstance(v, dict) or not all(isinstance(w, (int, float)) for w in v.values()):
                    raise TaskRecordError("preference['tools'] must map tool names to numbers")
            elif not isinstance(v, (int, float)) or v < 0:
                raise TaskRecordError(f"preference['{k}'] must be a number >= 0")
        verifier = d.get("verifier", {"type": "exact"})
        if not isinstance(verifier, dict) or verifier.get("type") not in VERIFIER_TYPES:
            raise TaskRecordError(f"task record field 'verifier.type' must be one of {VERIFIER_TYPES}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def load_jsonl(path: str) -> list[TaskRecord]:
    """Read a task file; a malformed line raises with its line number and the reason."""
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(TaskRecord.from_dict(json.loads(line)))
            except json.JSONDecodeError as e:
                raise TaskRecordError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            except TaskRecordError as e:
                raise TaskRecordError(f"{path}:{lineno}: {e}") from None
    return records
