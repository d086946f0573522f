"""``key=value`` command lines onto typed dataclass configs (used by the synthesize and evaluate recipes).

Dotted keys reach nested dataclasses (``llm.base_url=...``) and dict fields (``mix.lookup=0.3``).
Values are read as YAML scalars and must fit the type of the field's default; an unknown key
is a ``ValueError`` naming it and listing the valid keys at that level.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml


def parse_key_values(argv: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"argument {item!r} is not of the form key=value")
        pairs.append((key.strip(), value))
    return pairs


def _coerce(key: str, raw: str, current: Any) -> Any:
    value = yaml.safe_load(raw) if raw != "" else ""
    if current is None or value is None:
        return value if value is not None or current is None else None
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true or false, got {raw!r}")
        return value
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(current, list):
        return value if isinstance(value, list) else [v.strip() for v in str(raw).split(",") if v.strip()]
    if isinstance(current, str):
        return raw
    if not isinstance(value, type(current)):
        raise ValueError(f"{key}: expected {type(current).__name__}, got {raw!r}")
    return value


def apply_overrides(cfg: Any, pairs: list[tuple[str, str]]) -> Any:
    """Set each dotted key on the dataclass ``cfg`` (in place); returns ``cfg``."""
    for key, raw in pairs:
        obj, parts = cfg, key.split(".")
        for i, part in enumerate(parts):
            here = ".".join(parts[: i + 1])
            last = i == len(parts) - 1
            if dataclasses.is_dataclass(obj):
                names = [f.name for f in dataclasses.fields(obj)]
                if part not in names:
                    raise ValueError(f"unknown key '{here}'; valid keys: {', '.join(names)}")
                if last:
                    setattr(obj, part, _coerce(key, raw, getattr(obj, part)))
                else:
                    obj = getattr(obj, part)
            elif isinstance(obj, dict):
                if last:
                    sample = next(iter(obj.values()), None)
                    obj[part] = _coerce(key, raw, obj.get(part, sample))
                else:
                    raise ValueError(f"unknown key '{here}': '{'.'.join(parts[:i])}' holds plain values")
            else:
                raise ValueError(f"unknown key '{here}': '{'.'.join(parts[:i])}' is not a section")
    return cfg
