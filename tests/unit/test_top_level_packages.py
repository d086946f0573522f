"""The wheel's top-level packages are the project's own. A top-level name that another distribution owns (as
``kernels`` is Hugging Face's, which transformers imports) shadows it, or is shadowed by it, wherever both are
installed; a module of ours belongs under ``nemo_orchestra/`` instead."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sysconfig
from fnmatch import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
OWN = ("nemo_orchestra", "tools_env")
DIST = "nemo-orchestra"


def top_level_packages(root: Path = ROOT) -> list[str]:
    """The top-level packages ``[tool.setuptools.packages.find]`` of ``root/pyproject.toml`` puts in the wheel:
    folders of ``root`` with an ``__init__.py`` that an ``include`` pattern matches and no ``exclude`` pattern does."""
    find = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    include, exclude = find.get("include", ["*"]), find.get("exclude", [])
    return sorted(
        p.parent.name
        for p in root.glob("*/__init__.py")
        if any(fnmatch(p.parent.name, pat) for pat in include)
        and not any(fnmatch(p.parent.name, pat) for pat in exclude)
    )


def foreign(names) -> list[str]:
    """The names of ``names`` that are not the project's own top-level packages."""
    return sorted(set(names) - set(OWN))


def test_the_wheel_holds_only_the_projects_packages():
    found = top_level_packages()
    assert foreign(found) == [], f"top-level packages other than {OWN} in the wheel: {foreign(found)}"
    assert found == sorted(OWN), found


def test_the_installed_distribution_holds_only_the_projects_packages():
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{DIST} is not installed")
    listed = (dist.read_text("top_level.txt") or "").split()
    assert foreign(listed) == [], f"{DIST} installs top-level packages other than {OWN}: {foreign(listed)}"
    owned = [name for name, dists in importlib.metadata.packages_distributions().items() if DIST in dists]
    assert foreign(owned) == [], f"{DIST} installs top-level packages other than {OWN}: {foreign(owned)}"


def test_kernels_is_not_the_projects():
    """``import kernels`` finds Hugging Face's package or nothing, never ours: not a folder of the checkout
    (an installed distribution's files under a virtual environment inside the checkout are not the checkout's),
    and not a file our distribution installs."""
    spec = importlib.util.find_spec("kernels")
    places = [] if spec is None else [spec.origin, *(spec.submodule_search_locations or [])]
    site = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    installed = [p for p in places if p and any(Path(p).resolve().is_relative_to(s) for s in site)]
    ours = [p for p in places if p and p not in installed and Path(p).resolve().is_relative_to(ROOT)]
    assert ours == [], f"`import kernels` resolves into the repository: {ours}"
    owners = importlib.metadata.packages_distributions().get("kernels", []) if installed else []
    assert DIST not in owners, f"{DIST} installs a top-level `kernels`: {installed}"


def test_the_check_names_a_planted_package(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.packages.find]\ninclude = ["nemo_orchestra*", "kernels*", "tools_env*"]\nexclude = ["tools_env"]\n'
    )
    for name in ("nemo_orchestra", "kernels", "tools_env", "recipes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "scripts").mkdir()  # no __init__.py: not a package
    assert top_level_packages(tmp_path) == ["kernels", "nemo_orchestra"]
    assert foreign(top_level_packages(tmp_path)) == ["kernels"]
