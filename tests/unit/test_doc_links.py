"""The documentation's relative links resolve, and the README stays a short front door.

Every markdown link ``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)`` and reference definition
``[ref]: path`` in the README, the changelog, ``tools_env/README.md``, ``tests/README.md`` and ``docs/**/*.md``
whose target is not a URL (``http:``, ``https:``, ``mailto:``) must name a file or folder that exists, relative
to the linking file and inside the repository; an anchor into a ``.md`` file must be the GitHub slug of one of
its headings (lowercase, spaces to ``-``, punctuation other than ``-`` and ``_`` dropped, ``-1``, ``-2`` ... for
repeats). Links inside code (fenced blocks, inline spans) are text, not links.

The code's docstrings, comments and ``--help`` text name repository paths too, and those must exist: in the
Python and shell files under ``nemo_orchestra/``, ``tools_env/``, ``recipes/``, ``scripts/`` and ``benchmarks/``,
the YAML files under ``conf/`` (their comments are the main job's ``--help``; another recipe's help is its
docstring and its dataclass's comments, in the files above), and the main job's ``--help`` for the base config
and each recipe, every token that starts with a top-level folder (``nemo_orchestra/``, ``tools_env/``,
``recipes/``, ``scripts/``, ``conf/``, ``docs/``, ``tests/``, ``benchmarks/``) and names a file (``docs/testing.md``),
a folder (``tests/unit/``) or three levels (``tools_env/domains/bfcl``), and every ``train/x.py``-style path that
starts with a package of ``nemo_orchestra/`` or ``tools_env/`` (it must exist in one of them). A placeholder (``conf/recipes/NAME.yaml``, ``conf/<group>/``) is not a path; two levels without a suffix
(``tools_env/restarts``) may be a metric's name.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 220
QUICK_START = (
    "bash scripts/setup.sh && .venv/bin/python recipes/grpo_orchestrator.py",
    ".venv/bin/python -m pytest -q",
)

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)[\s\S]*?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>\n]*>|[^)\s]+)(?:\s+\"[^\"\n]*\")?\s*\)")
REFERENCE = re.compile(  # a whole line: [label]: target, an optional quoted title and nothing else
    r"^\s{0,3}\[[^\]]+\]:[ \t]*(<[^>\n]*>|\S+)(?:[ \t]+(?:\"[^\"\n]*\"|'[^'\n]*'|\([^)\n]*\)))?[ \t]*$", re.MULTILINE
)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = ("http://", "https://", "mailto:")


def doc_files(root: Path = ROOT) -> list[Path]:
    """The markdown files whose links are checked."""
    files = [root / "README.md", root / "CHANGELOG.md", root / "tools_env" / "README.md"]
    if (root / "tests" / "README.md").exists():
        files.append(root / "tests" / "README.md")
    files += sorted((root / "docs").rglob("*.md"))
    return files


def _outside_fences(text: str) -> list[str]:
    """The lines of ``text`` with every fenced code block's lines (fences included) blanked."""
    lines, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            lines.append("")
        elif fence is not None:
            if m and m.group(1).startswith(fence):
                fence = None
            lines.append("")
        else:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    out = []
    for ch in text.strip().lower():
        if ch.isalnum() or ch in "-_":
            out.append(ch)
        elif ch == " ":
            out.append("-")
    return "".join(out)


def anchors(md: Path) -> set[str]:
    """Every anchor a link may name in ``md``: its headings' slugs (repeats numbered) and HTML ids."""
    seen: dict[str, int] = {}
    found = set()
    for line in _outside_fences(md.read_text(encoding="utf-8")):
        found.update(HTML_ID.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(md: Path) -> list[tuple[int, str]]:
    """(line, target) of every link in ``md`` outside code."""
    text = "\n".join(_outside_fences(md.read_text(encoding="utf-8")))
    text = INLINE_CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    found = []
    for pattern in (LINK, REFERENCE):
        for m in pattern.finditer(text):
            found.append((text.count("\n", 0, m.start()) + 1, m.group(1).strip("<>")))
    return sorted(found)


def broken_links(md: Path, root: Path = ROOT) -> list[str]:
    """One line per link of ``md`` that does not resolve: ``file:line: target: why``."""
    root = root.resolve()
    problems = []
    cache: dict[Path, set[str]] = {}
    for line, target in links(md):
        if target.lower().startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / unquote(path)).resolve() if path else md.resolve()
        where = f"{md.relative_to(root) if md.resolve().is_relative_to(root) else md}:{line}: {target}"
        if not dest.is_relative_to(root):
            problems.append(f"{where}: outside the repository")
        elif not dest.exists():
            problems.append(f"{where}: no such file or folder")
        elif anchor and dest.is_file() and dest.suffix == ".md":
            if dest not in cache:
                cache[dest] = anchors(dest)
            if unquote(anchor) not in cache[dest]:
                problems.append(f"{where}: no heading with this anchor in {dest.name}")
    return problems


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("md", doc_files(), ids=_rel)
def test_relative_links_resolve(md):
    assert md.exists(), f"{_rel(md)} is missing"
    problems = broken_links(md)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checked_set_covers_the_docs():
    names = {_rel(p) for p in doc_files()}
    assert {"README.md", "CHANGELOG.md", "tools_env/README.md", "docs/architecture.md"} <= names
    assert any(n.startswith("docs/results/") for n in names)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


def first_code_block(md_text: str) -> list[str]:
    """The non-blank lines of the first fenced code block, stripped."""
    block, fence = None, None
    for line in md_text.splitlines():
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence, block = m.group(1), []
        elif m and m.group(1).startswith(fence):
            return [x.strip() for x in block if x.strip()]
        else:
            block.append(line)
    return []


def test_readme_quick_start_is_the_first_code_block():
    assert first_code_block((ROOT / "README.md").read_text(encoding="utf-8")) == list(QUICK_START)


# ---- the checker itself -----------------------------------------------------------------------------


def test_slug_follows_github():
    assert slug("When a run stops") == "when-a-run-stops"
    assert slug("Synthesis: `recipes/synthesize_data.py`") == "synthesis-recipessynthesize_datapy"
    assert slug("The last layer on the loss's rows") == "the-last-layer-on-the-losss-rows"
    assert slug("Memory plan (colocation)") == "memory-plan-colocation"
    assert slug("tools_env — the tool-environment service") == "tools_env--the-tool-environment-service"
    assert slug("See [the guide](docs/x.md) first") == "see-the-guide-first"


def test_checker_reports_what_does_not_resolve(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Run it\n\n## Run it\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n"
        "[ok](docs/guide.md) [ok](docs/guide.md#run-it) [ok](docs/guide.md#run-it-1) [ok](docs/) [ok](#top)\n"
        "[web](https://example.com/missing) [mail](mailto:a@b.c)\n"
        "[gone](docs/missing.md)\n"
        "[bad anchor](docs/guide.md#walk-it)\n"
        "[bad local](#bottom)\n"
        "[escape](../outside.md)\n"
        "![img](docs/missing.png)\n"
        "[wrapped\ntext](docs/nowhere.md)\n"
        "`[code](docs/ignored.md)`\n"
        "```\n[fenced](docs/ignored.md)\n```\n"
        "[0, 1]: a bracket at a line's start, not a definition\n"
        "[ref]: docs/absent.md\n",
        encoding="utf-8",
    )
    (tmp_path.parent / "outside.md").write_text("x", encoding="utf-8")
    problems = broken_links(page, root=tmp_path)
    reported = sorted(p.split(": ")[1] for p in problems)
    assert reported == sorted(
        [
            "docs/missing.md",
            "docs/guide.md#walk-it",
            "#bottom",
            "../outside.md",
            "docs/missing.png",
            "docs/nowhere.md",
            "docs/absent.md",
        ]
    ), problems
    assert any(p.startswith("README.md:4: docs/missing.md") for p in problems), problems


def test_first_code_block_reads_the_first_fence_only():
    text = "# x\n\ntext\n\n```bash\ncmd one\n\n  cmd two\n```\n\n```\nlater\n```\n"
    assert first_code_block(text) == ["cmd one", "cmd two"]
    assert first_code_block("no code\n") == []


# ---- paths named in the code --------------------------------------------------------------------------------

CODE_DIRS = ("nemo_orchestra", "tools_env", "recipes", "scripts", "benchmarks")
TOP_FOLDERS = ("nemo_orchestra", "tools_env", "recipes", "scripts", "conf", "docs", "tests", "benchmarks")
PACKAGE_ROOTS = ("nemo_orchestra", "tools_env")  # where a short path (``train/step.py``) resolves
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")  # NAME, FILE, X: a component to fill in


def code_files(root: Path = ROOT) -> list[Path]:
    """The files whose named paths are checked: Python and shell under ``CODE_DIRS``, YAML under ``conf/``."""
    files = [p for d in CODE_DIRS for p in (root / d).rglob("*") if p.suffix in (".py", ".sh") and p.is_file()]
    return sorted(files + list((root / "conf").rglob("*.yaml")))


def _patterns(root: Path) -> tuple[re.Pattern, re.Pattern]:
    """Paths from a top-level folder, and short ``.py`` paths from a package of ``PACKAGE_ROOTS``."""
    subs = sorted({p.parent.name for base in PACKAGE_ROOTS for p in (root / base).glob("*/__init__.py")})
    start = r"(?<![\w./~$-])"  # not inside a longer path, an absolute path or a dotted name
    full = re.compile(start + r"((?:%s)/[\w./-]*)" % "|".join(TOP_FOLDERS))
    short = re.compile(start + r"((?:%s)/[\w/.-]*\.py)(?![\w/])" % "|".join(subs or ["(?!)"]))
    return full, short


def named_paths(text: str, root: Path = ROOT) -> list[tuple[int, str, bool]]:
    """(line, path, short) of every repository path ``text`` names; ``short`` paths resolve under a package."""
    full, short = _patterns(root)
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in full.finditer(line):
            path = m.group(1).rstrip(".,-")
            parts = path.rstrip("/").split("/")
            if any(PLACEHOLDER.fullmatch(Path(c).stem) for c in parts[1:]):
                continue
            if "." in parts[-1] or path.endswith("/") or len(parts) >= 3:
                found.append((n, path, False))
        found += [(n, m.group(1), True) for m in short.finditer(line)]
    return found


def stale_paths(text: str, where: str, root: Path = ROOT) -> list[str]:
    """One line per path ``text`` names that does not exist: ``where:line: path``."""
    problems = []
    for n, path, short in named_paths(text, root):
        bases = [root / b for b in PACKAGE_ROOTS] if short else [root]
        if not any((b / path).exists() for b in bases):
            problems.append(f"{where}:{n}: {path}")
    return problems


def test_paths_named_in_the_code_exist():
    problems = [p for f in code_files() for p in stale_paths(f.read_text(encoding="utf-8"), _rel(f))]
    assert not problems, "paths that do not exist:\n" + "\n".join(problems)


def test_paths_named_in_the_main_jobs_help_exist():
    from nemo_orchestra.config import CONF_DIR
    from nemo_orchestra.config_help import main_keys_help

    recipes = sorted(p.stem for p in (CONF_DIR / "recipes").glob("*.yaml"))
    problems = []
    for overrides in [[]] + [[f"recipe={r}"] for r in recipes]:
        problems += stale_paths(main_keys_help(overrides), f"--help {' '.join(overrides)}".strip())
    assert not problems, "paths that do not exist:\n" + "\n".join(problems)


def test_the_checked_code_covers_every_folder():
    names = {_rel(p) for p in code_files()}
    assert {"recipes/grpo_orchestrator.py", "scripts/gpu_checks.sh", "conf/grpo_orchestrator.yaml"} <= names
    assert {d for d in CODE_DIRS if any(n.startswith(f"{d}/") for n in names)} == set(CODE_DIRS)


def test_path_checker_reports_a_stale_path(tmp_path):
    for f in (
        "nemo_orchestra/runtime/reaper.py",
        "nemo_orchestra/runtime/__init__.py",
        "tools_env/sandbox/__init__.py",
        "tools_env/sandbox/zygote.py",
        "nemo_orchestra/train/__init__.py",
        "tests/unit/test_x.py",
        "docs/guide.md",
        "conf/base.yaml",
    ):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    text = (
        "every process ends with it (runtime/reaper.py); see ``nemo_orchestra/runtime/reaper.py``\n"
        "its README (docs/guide.md), its tests (tests/unit/, `tests/unit/test_x.py`), sandbox/zygote.py\n"
        "a stale one (train/reaper.py), `nemo_orchestra/train/reaper.py` and docs/gone.md.\n"
        "not paths: conf/recipes/NAME.yaml, conf/<group>/x.yaml, tools_env/restarts, /abs/tests/x.py, ../docs/y.md,\n"
        "  runs/docs/z.md, nemo_orchestra.train.reaper, input/output, tokens/s, data/train.jsonl\n"
        "a folder: tests/integration/ and tools_env/domains/bfcl\n"
    )
    problems = stale_paths(text, "x.py", root=tmp_path)
    assert problems == [
        "x.py:3: nemo_orchestra/train/reaper.py",
        "x.py:3: docs/gone.md",
        "x.py:3: train/reaper.py",
        "x.py:6: tests/integration/",
        "x.py:6: tools_env/domains/bfcl",
    ], problems
