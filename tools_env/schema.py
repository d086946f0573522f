"""The service's JSON schemas: one source for request validation and for ``/openapi.json``.

Schemas are written in the OpenAPI 3.0 dialect of JSON Schema (``nullable: true`` for a field
that may be ``null``). ``check(value, schema, what)`` validates a value against one and returns
the first problem as a message naming the field (``task record field 'prices.gpt.input' must
be a number >= 0``), or None. It implements the keywords these schemas use and nothing more:
``type``, ``nullable``, ``enum``, ``minimum``, ``minLength``, ``maxLength``, ``pattern``,
``properties``, ``required``, ``additionalProperties``, ``items``, ``minItems``,
``uniqueItems``; a keyword it does not know is an error, so a schema cannot silently promise
more than is checked.

The task record's tool list is the one part that depends on the service: ``task_record_schema
(tool_names)`` restricts it to the service's tools (what ``POST /v1/episodes`` accepts), and
without names to any string (what a task file may hold).
"""

from __future__ import annotations

import re
from typing import Any

EPISODE_ID_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$"
ANY: dict[str, Any] = {}  # any JSON value, null included

_S = {"type": "string"}
_N0 = {"type": "number", "minimum": 0}
_COUNTS = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}


def obj(
    props: dict[str, Any], required: list[str] | tuple[str, ...] = (), extra: Any = False, **more: Any
) -> dict[str, Any]:
    """An object schema; ``extra`` is ``additionalProperties`` (False: only the listed fields)."""
    schema = {"type": "object", "properties": props, "additionalProperties": extra, **more}
    if required:
        schema["required"] = list(required)
    return schema


PRICES = obj(
    {},
    extra=obj({"input": _N0, "output": _N0}),
    description="{alias: {input, output}} in $ per 1M tokens, overriding the configured prices",
)
PREFERENCE = obj(
    {"tools": {"type": "object", "additionalProperties": {"type": "number"}}},
    extra=_N0,
    description="weights >= 0 of accuracy, cost, latency, ...; tools: {tool: weight}",
)


def verifier_schema(types: list[str] | None = None) -> dict[str, Any]:
    """``types``: the verifier types a service has registered (``tools_env.verify.VERIFIERS``); None (a
    task file read outside a service): any name, checked when a service creates the episode."""
    kind = {"type": "string", "enum": sorted(types)} if types is not None else {"type": "string", "minLength": 1}
    return obj(
        {"type": kind, "aliases": {"type": "array", "items": _S}, "rel_tol": _N0, "abs_tol": _N0}, ["type"], extra=True
    )


def task_record_schema(tool_names: list[str] | None = None, verifier_types: list[str] | None = None) -> dict[str, Any]:
    tool = {"type": "string", "enum": sorted(tool_names)} if tool_names is not None else _S
    return obj(
        {
            "problem": _S,
            "answer": _S,
            "category": _S,
            "tools": {"type": "array", "items": tool, "minItems": 1, "uniqueItems": True},
            "id": {**_S, "description": "stable identifier; empty: a hash of the problem"},
            "prices": PRICES,
            "preference": PREFERENCE,
            "verifier": verifier_schema(verifier_types),
            "system": {
                **_S,
                "nullable": True,
                "description": "the task's own instructions (a domain's policy), in the system message after the "
                "orchestrator's; null: none",
            },
            "domain": {**_S, "nullable": True},
            "gold_actions": {"type": "array", "items": {"type": "object"}},
            "max_turns": {
                "type": "integer",
                "minimum": 1,
                "nullable": True,
                "description": "the policy turns the episode may take; null: the caller's limit",
            },
            "meta": {"type": "object", "description": "free-form, carried through"},
        },
        ["problem", "answer", "category", "tools"],
    )


STEP_REQUEST = obj(
    {
        "name": {"description": "a tool of the episode; anything else is answered with an error observation"},
        "arguments": {
            "description": "an object, or a string holding one (OpenAI style); anything else, or "
            "arguments that do not fit the tool, is answered with an error observation"
        },
    }
)
OUTCOME = obj(
    {
        "correct": {"type": "boolean"},
        "score": {"type": "number"},
        "reason": _S,
        "turn_passed": {"type": "array", "items": {"type": "boolean"}},  # per user turn, where judged so
        "record": {
            "type": "object",
            "description": "the grader's own record of the episode, where it keeps one (tau2: its SimulationRun)",
        },
    },
    ["correct", "score", "reason"],
)
STEP_RESPONSE = obj(
    {
        "observation": _S,
        "cost": _N0,
        "latency_s": _N0,
        "done": {"type": "boolean"},
        "error": {**_S, "nullable": True},
        "outcome": OUTCOME,
    },
    ["observation", "cost", "latency_s", "done", "error"],
)
_SUMMARY_PROPS = {
    "episode_id": _S,
    "task_id": _S,
    "status": {"type": "string", "enum": ["active", "done", "expired"]},
    "turns": {"type": "integer", "minimum": 0},
    "total_cost": _N0,
    "total_latency_s": _N0,
    "tool_counts": _COUNTS,
    "model_counts": _COUNTS,
    "error_count": {"type": "integer", "minimum": 0},
    "user": obj(  # a simulated user's totals (tau2's conversations); zeros where the task has none
        {
            "cost": _N0,
            "latency_s": _N0,
            "tokens_in": {"type": "integer", "minimum": 0},
            "tokens_out": {"type": "integer", "minimum": 0},
        },
        ["cost", "latency_s", "tokens_in", "tokens_out"],
    ),
    "ended_by": {"type": "string", "enum": ["answer", "max_turns", "max_cost", "max_wall_s"], "nullable": True},
    "outcome": {**OUTCOME, "nullable": True},
    "age_s": _N0,
}
EPISODE_SUMMARY = obj(_SUMMARY_PROPS, list(_SUMMARY_PROPS))
EPISODE_DELETED = obj({**_SUMMARY_PROPS, "deleted": {"type": "boolean", "enum": [True]}}, [*_SUMMARY_PROPS, "deleted"])
EPISODE_CREATED = obj(
    {"episode_id": _S, "tools": {"type": "array", "items": {"type": "object"}}}, ["episode_id", "tools"]
)
TOOL_LIST = obj({"tools": {"type": "array", "items": {"type": "object"}}}, ["tools"])
HEALTH = obj(
    {
        "status": {"type": "string", "enum": ["ok"]},
        "worker": {"type": "integer", "minimum": 0},
        "episodes": {"type": "integer", "minimum": 0},
    },
    ["status", "worker", "episodes"],
)
ERROR = obj({"error": obj({"code": _S, "message": _S}, ["code", "message"])}, ["error"])


# ---- the validator ---------------------------------------------------------------------------

_TYPES = {
    "string": "a string",
    "number": "a number",
    "integer": "an integer",
    "boolean": "a boolean",
    "object": "an object",
    "array": "an array",
}
_KNOWN = {
    "type",
    "nullable",
    "enum",
    "minimum",
    "minLength",
    "maxLength",
    "pattern",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "uniqueItems",
    "description",
}


def _is(value: Any, typ: str) -> bool:
    if typ == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ == "integer":  # JSON Schema: any number with a zero fractional part (3 and 3.0 alike)
        if isinstance(value, float):
            return value.is_integer()
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "object": dict, "array": list}[typ])


def integers(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` (which fits ``schema``) with each integral float where the schema says integer made an int."""
    typ = schema.get("type")
    if typ == "integer" and isinstance(value, float):
        return int(value)
    if typ == "array" and isinstance(value, list):
        return [integers(v, schema.get("items", ANY)) for v in value]
    if typ == "object" and isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
        return {k: integers(v, props.get(k, extra if isinstance(extra, dict) else ANY)) for k, v in value.items()}
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def check(value: Any, schema: dict[str, Any], what: str, path: str = "") -> str | None:
    """The first way ``value`` breaks ``schema``, as a message naming the field; None if it fits."""
    unknown = set(schema) - _KNOWN
    assert not unknown, f"schema keyword(s) {sorted(unknown)} are not implemented by tools_env.schema.check"
    where = f"{what} field '{path}'" if path else what
    if value is None:
        return None if schema.get("nullable") or "type" not in schema else f"{where} must not be null"
    typ = schema.get("type")
    if typ is not None and not _is(value, typ):
        bound = f" >= {schema['minimum']:g}" if "minimum" in schema else ""
        return f"{where} must be {_TYPES[typ]}{bound}, got {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {', '.join(map(str, schema['enum']))}, got {str(value)[:80]!r}"
    if "minimum" in schema and value < schema["minimum"]:
        return f"{where} must be {_TYPES[typ]} >= {schema['minimum']:g}, got {value!r}"
    if typ == "string":
        return _check_string(value, schema, where)
    if typ == "array":
        return _check_array(value, schema, what, path, where)
    if typ == "object":
        return _check_object(value, schema, what, path, where)
    return None


def _check_string(value: str, schema: dict[str, Any], where: str) -> str | None:
    if len(value) < schema.get("minLength", 0):
        return f"{where} must have at least {schema['minLength']} character(s)"
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        return f"{where} must have at most {schema['maxLength']} characters"
    if "pattern" in schema and not re.search(_ecma(schema["pattern"]), value):
        return f"{where} must match {schema['pattern']}"
    return None


def _ecma(pattern: str) -> str:
    """A trailing ``$`` matches only at the very end, as in JSON Schema (Python's also before a final newline)."""
    return pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith(r"\$") else pattern


def _check_array(value: list, schema: dict[str, Any], what: str, path: str, where: str) -> str | None:
    if len(value) < schema.get("minItems", 0):
        return f"{where} must have at least {schema['minItems']} item(s)"
    if schema.get("uniqueItems") and len({repr(v) for v in value}) != len(value):
        return f"{where} lists an item twice"
    for i, item in enumerate(value):
        error = check(item, schema.get("items", ANY), what, f"{path}[{i}]")
        if error:
            return error
    return None


def _check_object(value: dict, schema: dict[str, Any], what: str, path: str, where: str) -> str | None:
    props = schema.get("properties", {})
    for key in schema.get("required", ()):
        if key not in value:
            return f"{where} is missing '{key}'"
    extra = schema.get("additionalProperties", True)
    if extra is False:
        unknown = sorted(k for k in value if k not in props)
        if unknown:
            return f"{where} has unknown field(s) {', '.join(map(repr, unknown))}; known: {', '.join(props)}"
    for key, item in value.items():
        sub = props.get(key, extra if isinstance(extra, dict) else None)
        error = None if sub is None else check(item, sub, what, f"{path}.{key}" if path else key)
        if error:
            return error
    return None
