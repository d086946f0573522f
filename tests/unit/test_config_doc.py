"""docs/configuration.md's table of keys says what the loader resolves: every cell is checked."""

import functools
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_orchestra.config import CONF_DIR, GROUPS, choices, load_config, to_dict
from nemo_orchestra.config_help import _show

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _table() -> tuple[list[str], list[list[str]]]:
    """The header's columns and the rows of the table under 'The keys that matter most'."""
    lines = DOC.read_text().split("## The keys that matter most", 1)[1].split("\n## ", 1)[0].splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    body = [[c.strip() for c in r.strip("|").split(" | ")] for r in rows[2:]]
    return header, [r for r in body if r[0].startswith("`")]


def _recipes(header: list[str]) -> list[str | None]:
    """None for the base file's column, else the recipe each column names (its first backticked word)."""
    return [None if h == "base file" else h.split("`")[1] for h in header[1:-1]]


@functools.cache
def _resolved(recipe: str) -> dict:
    return to_dict(load_config([f"recipe={recipe}"]))


@functools.cache
def _base():
    return OmegaConf.load(CONF_DIR / "grpo_orchestrator.yaml")


def cell(key: str, recipe: str | None) -> str:
    """What the table shows for ``key`` (a dotted key, or a group's name) in the base file or under a recipe."""
    if key in GROUPS:
        if recipe is None:
            value = _base().defaults.get(key, "(recipe's)")
        else:
            value = choices([f"recipe={recipe}"])[1][key]
    elif recipe is None:
        value = OmegaConf.select(_base(), key, default="(group's)")
    else:
        section, leaf = key.split(".", 1)
        value = _resolved(recipe)[section][leaf]
    return f"`{_show(value)}`"


def test_the_table_has_a_column_per_recipe_and_rows():
    header, rows = _table()
    recipes = _recipes(header)
    assert recipes[0] is None and "tiny_cpu" in recipes and len(rows) >= 20
    assert {p.stem for p in (CONF_DIR / "recipes").glob("*.yaml")} == set(recipes[1:])


@pytest.mark.parametrize("row", _table()[1], ids=lambda r: r[0].strip("`"))
def test_every_cell_is_what_the_loader_resolves(row):
    header, _ = _table()
    key = row[0].strip("`")
    assert len(row) == len(header), f"{key}: {len(row)} cells, the header has {len(header)}"
    for recipe, shown in zip(_recipes(header), row[1:-1]):
        assert shown == cell(key, recipe), f"{key} under {recipe or 'the base file'}: the doc says {shown}"


def test_a_changed_value_changes_the_cell():
    assert cell("trainer.max_steps", "tiny_cpu") == "`140`" and cell("trainer.max_steps", None) != "`140`"
