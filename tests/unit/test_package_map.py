"""The package map in docs/architecture.md matches the code: every package is on it, every module it
names exists, and a package whose row names its modules names all of them."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def _rows() -> dict[str, str]:
    """First cell's first path -> the row's text, from the table under "## The package map"."""
    text = DOC.read_text().split("## The package map", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        paths = re.findall(r"`([^`]+)`", cells[0]) if len(cells) > 1 else []
        if paths:
            rows[paths[0]] = line
    return rows


def test_every_package_is_on_the_map():
    rows = _rows()
    packages = sorted(f"nemo_orchestra/{p.parent.name}/" for p in (ROOT / "nemo_orchestra").glob("*/__init__.py"))
    assert [p for p in packages if p not in rows] == []
    for top in ("tools_env/", "recipes/", "benchmarks/", "scripts/", "conf/", "tests/"):
        assert top in rows, top


def test_the_modules_a_row_names_exist_and_are_all_there_are():
    for path, line in _rows().items():
        if not path.startswith("nemo_orchestra/") or not path.endswith("/"):
            continue
        named = {n for n in re.findall(r"`([\w/]+\.py)`", line)}
        if not named:  # a row that describes its package without naming modules
            continue
        folder = ROOT / path
        assert [n for n in named if not any(folder.rglob(n))] == [], path  # in the package or a subpackage
        modules = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
        assert sorted(modules - named) == [], f"{path}: modules not on the map"
