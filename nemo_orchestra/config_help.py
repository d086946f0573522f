"""``--help`` for the recipes, generated from the config schema.

A recipe's help is its docstring (what it does, its launch lines), then every key it takes with its
default and type: the dataclasses give the keys and types, the defaults are the values the loader
would use (for the main job: the base file, its group files and any overrides given beside
``--help``), and a key's description is the comment on its line, in the dataclass or in the YAML
file that sets it. Nothing is written twice.
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from nemo_orchestra.config import CONF_DIR, GROUPS, Config, choices, load_config, to_dict

HELP_FLAGS = ("-h", "--help")
_LINE = re.compile(r"^(\s*)([A-Za-z_][\w-]*)\s*:[^#]*?(?:#\s*(.*))?$")


def wants_help(argv: list[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def recipe_help(doc: str, own: type | None = None, main: bool = False, argv: list[str] = ()) -> str:
    """The help text: ``doc``, then the keys of ``own`` (a recipe's dataclass), then the main job's
    keys when ``main`` (the recipe passes them to ``load_config``); ``argv``'s overrides show in the defaults."""
    parts = [inspect.cleandoc(doc or "")]
    overrides = [a for a in argv if a not in HELP_FLAGS]
    if own is not None:
        mine = {f.name for f in fields(own)}
        defaults = OmegaConf.to_container(OmegaConf.structured(own))
        parts.append(f"Keys (key=value; default, type):\n{_key_table(own, defaults, _dataclass_comments(own))}")
        overrides = [a for a in overrides if a.split("=", 1)[0].split(".")[0] not in mine]
    if main:
        parts.append(main_keys_help(overrides))
    return "\n\n".join(parts) + "\n"


def main_keys_help(overrides: list[str] = ()) -> str:
    """The main job's groups and keys with their values after ``overrides`` (a recipe, a group, keys)."""
    defaults = to_dict(load_config(overrides))
    comments = {**_dataclass_comments(Config), **_yaml_comments(overrides)}
    groups = "\n".join(
        f"  {g}=NAME  one of {', '.join(sorted(p.stem for p in (CONF_DIR / g).glob('*.yaml')))}"
        f" (now: {_group_choice(g, overrides)})"
        for g in GROUPS
    )
    recipes = ", ".join(sorted(p.stem for p in (CONF_DIR / "recipes").glob("*.yaml")))
    chain = " on ".join(reversed(choices(overrides)[0])) or "none"
    return (
        f"Groups (conf/<group>/NAME.yaml):\n{groups}\n  recipe=NAME  one of {recipes} (conf/recipes/; now: {chain})\n\n"
        f"Main job keys (key=value; default, type):\n{_key_table(Config, defaults, comments)}"
    )


def _group_choice(group: str, overrides: list[str]) -> str:
    """The group file ``compose`` picks (``config.choices``)."""
    return choices(overrides)[1][group]


def _key_table(cls: type, values: dict, comments: dict[str, str], prefix: str = "") -> str:
    rows = []
    for key, typ in _leaf_keys(cls, prefix):
        value = _select(values, key[len(prefix) :] if prefix else key)
        note = comments.get(key, "")
        rows.append((key, _show(value), typ, note))
    width = min(max((len(k) + len(v) for k, v, _, _ in rows), default=0) + 3, 48)
    return "\n".join(f"  {f'{k} = {v}':<{width}}  {t}{'  # ' + n if n else ''}" for k, v, t, n in rows)


def _leaf_keys(cls: type, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, type name) for every leaf of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        typ = hints[f.name]
        if is_dataclass(typ):
            out += _leaf_keys(typ, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, _type_name(typ)))
    return out


def _type_name(typ: Any) -> str:
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is typing.Union or type(typ).__name__ == "UnionType":
        inner = [a for a in args if a is not type(None)]
        return " | ".join(_type_name(a) for a in inner) + (" | null" if len(inner) < len(args) else "")
    if origin in (dict, typing.Dict):
        return "mapping"
    if origin in (list, typing.List, tuple):
        return "list"
    return getattr(typ, "__name__", str(typ))


def _select(values: dict, key: str) -> Any:
    node: Any = values
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def _show(value: Any) -> str:
    if value is MISSING or value == "???":
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and value == "":
        return '""'
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "[]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return str(value)


def _dataclass_comments(cls: type, prefix: str = "") -> dict[str, str]:
    """``# comment`` at the end of each field's line in the dataclass sources (nested ones too)."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    for line in inspect.getsource(cls).splitlines():
        m = _LINE.match(line)
        if m and m.group(2) in names and m.group(3):
            out[prefix + m.group(2)] = m.group(3).strip()
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            out.update(_dataclass_comments(hints[f.name], f"{prefix}{f.name}."))
    return out


def _yaml_comments(overrides: list[str]) -> dict[str, str]:
    """Comments on the key lines of the base file, the chosen group files and the recipe chain (a comment that
    goes on in the lines below, indented under it, is joined to it). A recipe's comment says why it sets the
    value it does, so it follows the key's own description."""
    out = _file_comments(CONF_DIR / "grpo_orchestrator.yaml", "")
    chain, groups = choices(overrides)
    for g, name in groups.items():
        out.update(_file_comments(CONF_DIR / g / f"{name}.yaml", f"{g}."))
    for name in chain:
        for key, why in _file_comments(CONF_DIR / "recipes" / f"{name}.yaml", "").items():
            if key != "defaults.recipe":
                out[key] = f"{out[key]}; {name}: {why}" if out.get(key) else f"{name}: {why}"
    return out


def _file_comments(path: Path, prefix: str) -> dict[str, str]:
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    last = None
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            if last is not None and line.index("#") > 0 and line.startswith(" "):
                out[last] = f"{out[last]} {line.strip().lstrip('#').strip()}"
            continue
        m = _LINE.match(line)
        if not m:
            last = None
            continue
        indent, key = len(m.group(1)), m.group(2)
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, key)]
        dotted = prefix + ".".join(k for _, k in stack)
        last = dotted if m.group(3) else None
        if m.group(3):
            out[dotted] = m.group(3).strip()
    return out
