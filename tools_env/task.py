"""The task record: one line of a task jsonl file, and what an episode is created from.

A minimal QA record is ``{"problem": str, "answer": str, "category": str, "tools": [names]}``
(at least one tool, none twice). Its schema is ``tools_env.schema.task_record_schema``.
Optional fields:

- ``id``: a stable identifier (defaults to a hash of the problem).
- ``prices``: ``{alias: {"input": $/1M tokens, "output": $/1M tokens}}`` overriding the
  service's configured prices for expert aliases in this episode.
- ``preference``: ``{"accuracy": w, "cost": w, "latency": w, "tools": {tool: w}}`` — the
  user preference vector the composite reward applies (weights >= 0).
- ``verifier``: ``{"type": "exact" | "numeric" | "db_state" | "judge" | a registered type, ...}``; default exact.
- ``domain``: ToolScale-style domain name, with ``gold_actions`` for database-state tasks.
- ``max_turns``: the policy turns the episode may take (>= 1); None: the caller's limit.
- ``system``: the task's own instructions (a tau2 domain's policy), which the system message carries
  after the orchestrator's; None (left out of the record): none.
- ``meta``: free-form, carried through untouched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tools_env.schema import check, integers, task_record_schema  # noqa: F401  (re-exported)

TASK_RECORD_SCHEMA = task_record_schema()


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
    max_turns: int | None = None  # the episode's turn budget; None: the caller's limit
    system: str | None = None  # instructions of the task's own, after the orchestrator's system prompt
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = hashlib.sha1(self.problem.encode()).hexdigest()[:12]

    @classmethod
    def from_dict(cls, d: Any) -> "TaskRecord":
        """A record checked against ``tools_env.schema.task_record_schema()``, the schema the service's
        OpenAPI document publishes; ``TaskRecordError`` names the first field that breaks it."""
        if not isinstance(d, dict):
            raise TaskRecordError(f"task record must be a JSON object, got {type(d).__name__}")
        error = check(d, TASK_RECORD_SCHEMA, "task record")
        if error:
            raise TaskRecordError(error)
        return cls(**integers(d, TASK_RECORD_SCHEMA))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.system is None:
            del out["system"]
        return out

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
