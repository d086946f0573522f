"""The documentation's relative links resolve, and the README stays a short front door.

Every markdown link ``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)`` and reference definition
``[ref]: path`` in the README, the changelog, ``tools_env/README.md``, ``tests/README.md`` and ``docs/**/*.md``
whose target is not a URL (``http:``, ``https:``, ``mailto:``) must name a file or folder that exists, relative
to the linking file and inside the repository; an anchor into a ``.md`` file must be the GitHub slug of one of
its headings (lowercase, spaces to ``-``, punctuation other than ``-`` and ``_`` dropped, ``-1``, ``-2`` ... for
repeats). Links inside code (fenced blocks, inline spans) are text, not links.
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
