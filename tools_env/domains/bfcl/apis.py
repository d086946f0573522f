"""BFCL's multi-turn API classes: instances, function docs as tool schemas, calls.

Only the eight classes of the multi-turn categories are used (``CLASSES``); their modules import
the standard library and ``mpmath``. The memory and web-search classes of BFCL v4 (which need
sentence-transformers, faiss, serpapi) are never imported.

A call's result is what BFCL's executor records for it: a string as it is, a dict as
``json.dumps`` (``str`` when that fails), anything else as ``str``; an exception as
``"Error during execution: <message>"``. Arguments and mutable default values are copied for
every call, so no object is shared between episodes (``execute``).
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import os
from functools import cache, lru_cache
from typing import Any

from tools_env.domains.bfcl.package import require_bfcl

_PREFIX = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
CLASSES: dict[str, tuple[str, str]] = {  # class -> (module, function doc file)
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
STATELESS = {"MathAPI"}  # BFCL loads no scenario into these
# BFCL's parameter types -> JSON schema types ("tuple" and "any" appear in other categories' docs)
_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def data_dir() -> str:
    return os.path.join(os.path.dirname(require_bfcl().__file__), "data")


def api_class(name: str) -> type:
    if name not in CLASSES:
        raise KeyError(f"unknown BFCL class {name!r}; multi-turn classes: {', '.join(CLASSES)}")
    return getattr(require_bfcl(f"{_PREFIX}.{CLASSES[name][0]}"), name)


@cache
def function_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    """BFCL's function docs of one class, as shipped (``data/multi_turn_func_doc``)."""
    if class_name not in CLASSES:
        raise KeyError(f"unknown BFCL class {class_name!r}; multi-turn classes: {', '.join(CLASSES)}")
    with open(os.path.join(data_dir(), "multi_turn_func_doc", CLASSES[class_name][1])) as f:
        return tuple(json.loads(line) for line in f if line.strip())


@cache
def function_classes() -> dict[str, str]:
    """Function name -> the class that defines it (names are unique across the eight classes)."""
    owner: dict[str, str] = {}
    for cls in CLASSES:
        for doc in function_docs(cls):
            assert doc["name"] not in owner, f"BFCL function {doc['name']} defined twice"
            owner[doc["name"]] = cls
    return owner


def json_schema(params: Any) -> Any:
    """A BFCL parameter schema as JSON schema: ``dict`` -> object, ``float`` -> number, ``any`` -> no type."""
    if isinstance(params, list):
        return [json_schema(p) for p in params]
    if not isinstance(params, dict):
        return params
    out = {}
    for key, value in params.items():
        if key == "type" and isinstance(value, str):
            mapped = _TYPES.get(value, value)
            if mapped is not None:
                out[key] = mapped
        elif key == "properties" and isinstance(value, dict):
            out[key] = {k: json_schema(v) for k, v in value.items()}
        else:
            out[key] = json_schema(value)
    return out


def new_instances(involved: list[str], initial_config: dict[str, Any], long_context: bool) -> dict[str, Any]:
    """Fresh instances of the involved classes loaded with the entry's configuration (deep-copied)."""
    instances = {}
    for name in involved:
        instance = api_class(name)()
        if name not in STATELESS:
            instance._load_scenario(copy.deepcopy(initial_config.get(name, {})), long_context=long_context)
            # long-context scenarios put module-level records into the state as they are (TravelAPI's extra
            # credit cards, whose balances purchases change in place): one deep copy of the whole state
            # makes every object the instance's own and keeps the aliasing inside it
            vars(instance).update(copy.deepcopy(vars(instance)))
        instances[name] = instance
    return instances


def _result_text(value: Any) -> str:
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def execute(instances: dict[str, Any], name: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> str:
    """Run one function on the instance of the class that defines it; the result as BFCL records it."""
    cls = function_classes().get(name)
    if cls is None or cls not in instances or name.startswith("_"):
        return f"Error during execution: name '{name}' is not defined"
    method = getattr(instances[cls], name)
    args, kwargs = copy.deepcopy(args), {**_fresh_defaults(method, len(args)), **copy.deepcopy(kwargs or {})}
    try:
        return _result_text(method(*args, **kwargs))
    except Exception as e:  # BFCL records a raising call as its message
        return f"Error during execution: {e}"


def _fresh_defaults(method: Any, num_positional: int) -> dict[str, Any]:
    """Copies of the method's mutable default values (``post_tweet(mentions=[])``): the API stores them
    in its state and later calls extend them in place (``mention``), which would leak from one episode
    into every later one in the process (BFCL's own runs carry such leaks between entries)."""
    try:
        params = list(inspect.signature(method).parameters.values())[num_positional:]
    except (TypeError, ValueError):
        return {}
    return {p.name: copy.deepcopy(p.default) for p in params if isinstance(p.default, (list, dict, set))}


def parse_call(text: str) -> tuple[str, tuple, dict[str, Any]]:
    """``"mv(source='a', destination='b')"`` -> ``("mv", (), {"source": "a", "destination": "b"})``."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise ValueError("not a plain function call")
        args = tuple(ast.literal_eval(a) for a in node.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"BFCL call {text[:80]!r} does not parse: {e}") from None
    return node.func.id, args, kwargs


def call_as_action(text: str) -> dict[str, Any]:
    """A BFCL call string as ``{"name", "arguments"}`` with every argument by keyword (the policy's form)."""
    name, args, kwargs = parse_call(text)
    if args:
        cls = function_classes().get(name)
        if cls is None:
            raise ValueError(f"BFCL call {text[:80]!r}: unknown function {name!r}")
        params = [p for p in inspect.signature(getattr(api_class(cls), name)).parameters if p != "self"]
        if len(args) > len(params):
            raise ValueError(f"BFCL call {text[:80]!r}: {len(args)} positional arguments for {len(params)} parameters")
        kwargs = {**dict(zip(params, args)), **kwargs}
    return {"name": name, "arguments": kwargs}


def public_state(instance: Any) -> dict[str, Any]:
    """The attributes BFCL's state check compares: every one not starting with ``_``."""
    return {k: v for k, v in vars(instance).items() if not k.startswith("_")}
