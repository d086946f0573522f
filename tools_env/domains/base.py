"""What every ToolScale-style domain is made of, and the database plumbing they share.

A ``Domain`` has a SQLite schema, a seeded generator that fills it (deterministic from a
seed), a policy text the agent must follow, typed functions over the database (reads and
writes, each with a JSON schema) and task templates that sample a user scenario with its gold
actions from a seeded database. Domain functions take a ``DB`` and keyword arguments, use only
parameterized SQL, and raise ``DomainError`` for a request the data or the policy refuses;
a write either completes or leaves the database untouched (one transaction per call).

Episode isolation: the pristine database of (domain, seed) is built once per process and kept
as bytes; an episode gets its own file copy under ``<workdir>/domains/`` on first use.
"""

from __future__ import annotations

import os
import random
import sqlite3
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

TODAY = "2025-06-01"  # the domains' fixed "today": no wall clock ever reaches a database


class DomainError(ValueError):
    """A request the data or the domain policy refuses; the agent sees the message."""


class DB:
    """A thin parameterized-SQL wrapper over one sqlite3 connection."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        conn.row_factory = sqlite3.Row

    def all(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute(sql, params).fetchall()]

    def one(self, sql: str, params: tuple = ()) -> dict[str, Any] | None:
        row = self.conn.execute(sql, params).fetchone()
        return dict(row) if row is not None else None

    def get(self, table: str, key: str, value: Any, what: str) -> dict[str, Any]:
        """The row whose ``key`` equals ``value``; DomainError naming ``what`` if none."""
        assert table.isidentifier() and key.isidentifier()  # our own constants, never policy text
        row = self.one(f"SELECT * FROM {table} WHERE {key} = ?", (value,))
        if row is None:
            raise DomainError(f"{what} {value!r} not found")
        return row

    def run(self, sql: str, params: tuple = ()) -> None:
        self.conn.execute(sql, params)

    def next_id(self, table: str, prefix: str) -> str:
        """Deterministic new id: prefix + (row count + 1), so replays give the same ids."""
        assert table.isidentifier()
        n = self.conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
        return f"{prefix}{n + 1:04d}"


@dataclass
class DomainFunction:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments
    fn: Callable[..., Any]
    writes: bool


@dataclass
class DomainTask:
    """A sampled scenario: what the user asks, the gold actions, and how to read the answer."""

    scenario: str
    gold_actions: list[dict[str, Any]]
    answer: Callable[[list[Any]], str] | None = None  # from the gold actions' results; None: state only
    kind: str = ""


def arg(type_: str, description: str, enum: list | None = None, optional: bool = False) -> dict[str, Any]:
    spec = {"type": type_, "description": description}
    if enum is not None:
        spec["enum"] = enum
    if optional:
        spec["optional"] = True
    return spec


@dataclass
class Domain:
    name: str
    description: str
    policy: str
    schema_sql: str
    seed_fn: Callable[[DB, random.Random], None] | None = None
    functions: dict[str, DomainFunction] = field(default_factory=dict)
    templates: list[Callable[[DB, random.Random], DomainTask | None]] = field(default_factory=list)

    # -- declaration helpers (used as decorators in each domain module) --

    def seeder(self, fn: Callable[[DB, random.Random], None]) -> Callable:
        self.seed_fn = fn
        return fn

    def function(self, description: str, writes: bool = False, **params: dict[str, Any]) -> Callable:
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            props = {k: {kk: vv for kk, vv in v.items() if kk != "optional"} for k, v in params.items()}
            required = [k for k, v in params.items() if not v.get("optional")]
            schema = {"type": "object", "properties": props, "required": required}
            assert fn.__name__ not in self.functions, f"{self.name}.{fn.__name__} declared twice"
            self.functions[fn.__name__] = DomainFunction(fn.__name__, description, schema, fn, writes)
            return fn

        return wrap

    def template(self, fn: Callable[[DB, random.Random], DomainTask | None]) -> Callable:
        self.templates.append(fn)
        return fn

    # -- databases --

    def tool_name(self, function: str) -> str:
        return f"{self.name}_{function}"

    def build(self, seed: int) -> bytes:
        """The pristine seeded database, serialized (deterministic in ``seed``)."""
        conn = sqlite3.connect(":memory:")
        conn.executescript(self.schema_sql)
        db = DB(conn)
        assert self.seed_fn is not None, f"domain {self.name} has no seeder"
        self.seed_fn(db, random.Random(f"{self.name}:{seed}"))
        conn.commit()
        data = conn.serialize()
        conn.close()
        return data

    def call(self, db: DB, function: str, arguments: dict[str, Any]) -> Any:
        """Run one function in its own transaction; DomainError rolls the write back."""
        fn = self.functions[function]
        try:
            result = fn.fn(db, **arguments)
        except Exception:
            db.conn.rollback()
            raise
        db.conn.commit()
        return result


_PRISTINE: dict[tuple[str, int], bytes] = {}
_PRISTINE_LOCK = threading.Lock()


def pristine_bytes(domain: Domain, seed: int) -> bytes:
    key = (domain.name, int(seed))
    with _PRISTINE_LOCK:
        if key not in _PRISTINE:
            _PRISTINE[key] = domain.build(seed)
        return _PRISTINE[key]


def open_copy(domain: Domain, seed: int, path: str | None = None) -> DB:
    """A private database: a file at ``path`` (created from the pristine bytes on first use) or in memory."""
    if path is None:
        conn = sqlite3.connect(":memory:")
        conn.deserialize(pristine_bytes(domain, seed))
        return DB(conn)
    if not os.path.exists(path):
        folder = os.path.dirname(path)
        os.makedirs(os.path.dirname(folder), mode=0o700, exist_ok=True)  # the (lazily created) episode workdir
        os.makedirs(folder, mode=0o700, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(pristine_bytes(domain, seed))
        os.replace(tmp, path)  # atomic: a concurrent first use never sees half a file
    return DB(sqlite3.connect(path))


def dump_state(db: DB) -> dict[str, list[tuple]]:
    """Every table's rows, sorted, as plain tuples (the state the verifier compares)."""
    tables = [r["name"] for r in db.all("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
    state = {}
    for t in tables:
        rows = db.conn.execute(f'SELECT * FROM "{t}"').fetchall()
        state[t] = sorted((tuple(r) for r in rows), key=repr)
    return state


def diff_state(want: dict[str, list[tuple]], got: dict[str, list[tuple]], limit: int = 3) -> str:
    """Empty string when equal; else the first differing table with a few rows each way."""
    for table in sorted(set(want) | set(got)):
        w, g = want.get(table, []), got.get(table, [])
        if w == g:
            continue
        missing = [r for r in w if r not in g][:limit]
        extra = [r for r in g if r not in w][:limit]
        return f"table {table}: expected rows missing {missing}; unexpected rows {extra}"
    return ""
