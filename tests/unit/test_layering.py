"""The packages' import graph: no cycles (a function-level import counts: it only hides one),
``nemo_orchestra.config`` imports nothing of the library above it (only leaves, which import none of it), and
``nemo_orchestra.kernels`` nothing of the library outside itself (the kernels and their references stand alone)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("nemo_orchestra", "tools_env")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``name`` imports anywhere in its file, except under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(parts + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return (out & known) - {name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def _leaf(graph: dict[str, set[str]], module: str) -> bool:
    """``module``, and each package that importing it runs, imports nothing of the library."""
    parts = module.split(".")
    chain = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
    return all(not any(d.startswith("nemo_orchestra") for d in graph.get(m, set())) for m in chain)


def test_config_imports_nothing_above_it():
    """Only leaves: data modules that import nothing of the library (the engines' names and capabilities)."""
    graph = _graph()
    above = {m for m in graph["nemo_orchestra.config"] if m.startswith("nemo_orchestra") and not _leaf(graph, m)}
    assert above == set(), f"nemo_orchestra.config imports {sorted(above)}"
    assert not _leaf(graph, "nemo_orchestra.rollout.loop")  # the check sees a module that imports the library


def test_kernels_import_nothing_outside_themselves():
    graph = _graph()
    outside = {
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m == "nemo_orchestra.kernels" or m.startswith("nemo_orchestra.kernels.")
        for d in deps  # ``from nemo_orchestra import kernels`` names the root package, which holds only the version
        if d not in ("nemo_orchestra", "nemo_orchestra.kernels") and not d.startswith("nemo_orchestra.kernels.")
    }
    assert outside == set(), f"nemo_orchestra.kernels imports the library: {sorted(outside)}"
