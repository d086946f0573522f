"""The tool plug-in interface.

A tool is a class registered under its name with ``@register_tool``. The service builds one
instance per tool at start-up (``Tool(config)``) and calls ``schema(ctx)`` to show it to the
policy and ``await call(arguments, ctx)`` to execute it. A tool never raises for bad input from
the policy: it returns a ``ToolResult`` with ``error`` set, which the policy sees as an
observation. ``ToolArgumentError`` raised from ``call`` is turned into such a result by the
service.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tools_env.task import TaskRecord


class ToolArgumentError(ValueError):
    """The policy passed arguments that do not fit the tool's schema."""


@dataclass
class ToolResult:
    observation: str
    cost: float = 0.0  # dollars
    latency_s: float = 0.0  # wall-clock (or simulated) seconds of the call
    error: str | None = None
    done: bool = False  # True only for `answer`
    usage: dict[str, int] = field(default_factory=dict)  # tokens reported by an expert
    # ``meta["stated"]``: the part of the observation no text the policy wrote can reach (a simulated expert's
    # answer, the calculator's value, the corpus documents a search found), where a simulated writer may read a
    # stated answer (``tools.experts.write_answer``); a result without it states nothing a writer copies
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class EpisodeContext:
    """What a tool may know about the episode it runs in."""

    episode_id: str
    task: TaskRecord
    workdir: str  # private per-episode directory (sandbox, domain database copy)
    rng: random.Random
    turn: int = 0
    state: dict[str, Any] = field(default_factory=dict)  # per-episode scratch owned by tools


class Tool:
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}, "required": []}

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    def schema(self, ctx: EpisodeContext | None = None) -> dict[str, Any]:
        """OpenAI function-calling schema shown to the policy (Qwen3 `<tools>` block)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def call(self, arguments: dict[str, Any], ctx: EpisodeContext) -> ToolResult:
        raise NotImplementedError

    def check_argument_names(self, arguments: Any) -> dict[str, Any]:
        """An object with every required key and no unknown one; its property schemas. Raises
        ToolArgumentError."""
        return check_argument_names(self.name, self.parameters, arguments)

    def check_arguments(self, arguments: Any) -> dict[str, Any]:
        """Validate required keys and JSON types against ``parameters``; raise ToolArgumentError."""
        return check_arguments(self.name, self.parameters, arguments)


def check_argument_names(name: str, parameters: dict[str, Any], arguments: Any) -> dict[str, Any]:
    """``arguments`` is an object with every key ``parameters`` requires and none it lacks; returns
    its property schemas. Raises ToolArgumentError naming tool ``name`` and the key."""
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"{name}: arguments must be a JSON object")
    props = parameters.get("properties", {})
    for key in parameters.get("required", []):
        if key not in arguments:
            raise ToolArgumentError(f"{name}: missing argument '{key}'")
    for key in arguments:
        if key not in props:
            raise ToolArgumentError(f"{name}: unknown argument '{key}'")
    return props


def check_arguments(name: str, parameters: dict[str, Any], arguments: Any) -> dict[str, Any]:
    """``arguments`` fits the JSON schema ``parameters`` of tool ``name`` (keys, JSON types, enums);
    the service's check of every call, and the agent loop's (``rollout.loop.call_schema_error``)."""
    props = check_argument_names(name, parameters, arguments)
    for key, value in arguments.items():
        want = props[key].get("type")
        if want and not _json_type_ok(value, want):
            raise ToolArgumentError(f"{name}: argument '{key}' must be of type {want}")
        if "enum" in props[key] and value not in props[key]["enum"]:
            raise ToolArgumentError(f"{name}: argument '{key}' must be one of {props[key]['enum']}")
    return arguments


_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def _json_type_ok(value: Any, want: str) -> bool:
    if want in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _JSON_TYPES.get(want, (object,)))


TOOL_REGISTRY: dict[str, type[Tool]] = {}


def register_tool(cls: type[Tool]) -> type[Tool]:
    assert cls.name and cls.name not in TOOL_REGISTRY, f"tool name {cls.name!r} empty or taken"
    TOOL_REGISTRY[cls.name] = cls
    return cls


def get_tool_class(name: str) -> type[Tool]:
    if name not in TOOL_REGISTRY:
        raise KeyError(f"unknown tool '{name}'; known tools: {', '.join(sorted(TOOL_REGISTRY))}")
    return TOOL_REGISTRY[name]
