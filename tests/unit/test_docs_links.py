"""The documentation holds together: every relative link in the repository's Markdown
points at a file that exists (and, with ``#anchor``, at one of its headings), and the
docs cite only the repository's own contract, docs/contract.md, never a document, an
issue or an item number from outside the repository.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Folders whose Markdown is not ours (environments, caches) or not in the repository.
SKIPPED_PARTS = frozenset({"node_modules", "site-packages", "__pycache__", "report"})

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) or ![alt](target); the target ends at whitespace or ")"
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, mailto:, file:

# Citations of something outside the repository; the places checked for now are the
# prose ones (the code's comments and docstrings are checked once they are swept).
_CITATION = re.compile(
    r"§ ?\d|/shared/\w+\.md|\bissues? \d+|[(]issue\b|\bitems? \d+\b", re.IGNORECASE
)
CITATION_PLACES = (
    "README.md",
    "docs",
    "bench",
    "pyproject.toml",
    "markers",
    "sidecar",
    "tests",
    "systemd",
    ".ci",
)


def markdown_files(root: Path = ROOT) -> list[Path]:
    """Every ``*.md`` under ``root``, leaving out hidden folders (``.git``, a venv) and
    folders of third-party or generated files."""
    found = []
    for path in sorted(root.rglob("*.md")):
        parts = path.relative_to(root).parts[:-1]
        if any(p.startswith(".") or p in SKIPPED_PARTS for p in parts):
            continue
        found.append(path)
    return found


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of ``text`` outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: inline markup dropped, lower case, every
    character but letters, digits, ``-``, ``_`` and spaces removed, spaces made ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings; a repeated heading gets ``-1``, ``-2``, ...
    as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """``file:line: target (why)`` for each relative link of ``path`` that points at no
    file, or at a heading its file does not have."""
    problems = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if _EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}"
            if not linked.exists():
                problems.append(f"{where}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{where}: {target} (no heading #{anchor})")
    return problems


def citations(paths: list[Path]) -> list[str]:
    """``file:line: text`` for each line of the files under ``paths`` that cites an
    outside document, an issue or an item number."""
    found = []
    for place in paths:
        files = sorted(p for p in place.rglob("*") if p.is_file()) if place.is_dir() else [place]
        for path in files:
            if "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue  # a binary file (an image) cites nothing
            for number, line in enumerate(text.splitlines(), start=1):
                if _CITATION.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_the_repository_has_its_markdown() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/contract.md", "docs/architecture.md", "bench/RESULTS.md"} <= names


def test_every_relative_link_in_the_docs_points_at_a_file_and_heading() -> None:
    problems = [problem for path in markdown_files() for problem in broken_links(path)]
    assert problems == []


def test_the_readme_links_the_contract() -> None:
    assert "](docs/contract.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_docs_cite_no_outside_document_issue_or_item() -> None:
    assert citations([ROOT / place for place in CITATION_PLACES]) == []


@pytest.mark.parametrize(
    ("text", "broken"),
    [
        ("[ok](b.md) and [ok](b.md#two-words) and [self](#top-heading)", []),
        ("[gone](missing.md)", ["missing.md (no such file)"]),
        ("[wrong anchor](b.md#nowhere)", ["b.md#nowhere (no heading #nowhere)"]),
        ("[own anchor](#nowhere)", ["#nowhere (no heading #nowhere)"]),
        ("`[in code](missing.md)` and [web](https://example.org/x.md)", []),
        ("```\n[in a fence](missing.md)\n```", []),
    ],
)
def test_the_link_check_finds_what_is_broken(tmp_path: Path, text: str, broken: list[str]) -> None:
    (tmp_path / "b.md").write_text("# Title\n\n## Two `words`\n", encoding="utf-8")
    page = tmp_path / "a.md"
    page.write_text(f"# Top heading\n\n{text}\n", encoding="utf-8")
    assert [p.split(": ", 1)[1] for p in broken_links(page)] == broken


N = 4  # any number


@pytest.mark.parametrize(
    ("line", "cites"),
    [
        # the cited lines are built from a number, so this file cites nothing itself
        (f"as the requirements' §{N} say", True),
        ("see /work/shared/" + "requirements.md", True),
        ("(" + f"issue {N})", True),
        (f"fixed in issue {N}", True),
        (f"item {N}: a name", True),
        (f"the series of §{N}", True),
        ("docs/contract.md, Files", False),
        ("one item of the list", False),
        ("an issue tracker", False),
    ],
)
def test_the_citation_check_finds_outside_citations(line: str, cites: bool) -> None:
    assert bool(_CITATION.search(line)) is cites


def test_slugs_follow_github() -> None:
    assert slug("summary.log") == "summarylog"
    assert slug("Faults and bad input") == "faults-and-bad-input"
    assert slug("Prometheus metrics (`--metrics-port`)") == "prometheus-metrics---metrics-port"
    assert slug("The node daemon under systemd") == "the-node-daemon-under-systemd"
