"""The README and docs/ as a reader meets them: short enough to read, and every
relative link lands.

- README.md: at most 200 lines, no table cell over 40 words (a cell that long is
  a paragraph, and belongs in the guide or in benchmarks/RESULTS.md).
- docs/**/*.md: at most 600 lines each.
- Every relative link in README.md and docs/**/*.md points to a file that exists,
  and a `#fragment` to a heading that exists in it (GitHub's anchor rule).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 200
DOCS_MAX_LINES = 600
CELL_MAX_WORDS = 40

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+).*?\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every inline link or image, code spans and fenced
    blocks ignored; a link's text may run over several lines."""
    prose = dict(_prose_lines(text))
    lines = [prose.get(n, "") for n in range(1, len(text.splitlines()) + 1)]
    joined = "\n".join(_INLINE_CODE.sub("", line) for line in lines)
    for match in _LINK.finditer(joined):
        yield joined.count("\n", 0, match.start()) + 1, match.group(1)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_`
    dropped, each space a `-`."""
    text = _INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _prose_lines(path.read_text()):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        base = _anchor(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


def _cells(line: str) -> list[str]:
    row = line.strip().strip("|")
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row)]


def _broken_links(path: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for number, target in _links(path.read_text()):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # http(s), mailto: not checked offline
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
            continue
        if fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{where} (no heading with anchor #{fragment})")
    return broken


def test_the_readme_is_at_most_200_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_no_readme_table_cell_is_over_40_words() -> None:
    long = []
    for number, line in _prose_lines(README.read_text()):
        if not line.lstrip().startswith("|"):
            continue
        for cell in _cells(line):
            words = len(cell.split())
            if words > CELL_MAX_WORDS:
                long.append(f"README.md:{number}: a cell of {words} words: {cell[:60]}...")
    assert not long, "\n".join(long)


def test_every_docs_page_is_at_most_600_lines() -> None:
    pages = sorted(DOCS.rglob("*.md"))
    assert pages, "docs/ holds no markdown pages"
    long = [
        f"{page.relative_to(ROOT)}: {n} lines"
        for page in pages
        if (n := len(page.read_text().splitlines())) > DOCS_MAX_LINES
    ]
    assert not long, f"over {DOCS_MAX_LINES} lines:\n" + "\n".join(long)


def test_every_relative_link_lands() -> None:
    broken = [b for path in _markdown_files() for b in _broken_links(path)]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Getting started", "getting-started"),
        (
            "Starting from a plain DCP checkpoint (`elastrain run --resume-from`)",
            "starting-from-a-plain-dcp-checkpoint-elastrain-run---resume-from",
        ),
        ("versus.py — 2026-12-04 20:06 UTC", "versuspy--2026-12-04-2006-utc"),
        ("A step's fixed cost", "a-steps-fixed-cost"),
    ],
)
def test_anchors_follow_githubs_rule(heading: str, anchor: str) -> None:
    assert _anchor(heading) == anchor


def test_the_checks_see_what_they_check(tmp_path: Path) -> None:
    """The checkers find a broken link, a missing anchor and a long cell, and
    skip links inside code."""
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-heading) [gone](missing.md) [no\nanchor](there.md#nope)\n"
        "`[code](also-missing.md)`\n```\n[fenced](fenced-missing.md)\n```\n"
        "[web](https://example.com/x.md)\n"
    )
    text = page.read_text()
    assert [t for _, t in _links(text)] == [
        "there.md#a-heading",
        "missing.md",
        "there.md#nope",
        "https://example.com/x.md",
    ]
    assert _broken_links(page, root=tmp_path) == [
        "page.md:1: missing.md (no such file)",
        "page.md:1: there.md#nope (no heading with anchor #nope)",  # where the link starts
    ]
    cells = _cells("| a | " + "w " * 41 + "| c \\| d |")
    assert [len(c.split()) for c in cells] == [1, 41, 3]
