"""Every relative markdown link in README.md, server/README.md, ops/README.md and docs/**/*.md
points at a file or directory that exists, and every `#anchor` at a heading of its target
(GitHub's anchor rules).

Pages move (issue 28 moved README's design, operations and benchmark sections into docs/); a link
left behind fails here, naming the page, the line and the target.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) or [text](target "title"); text may hold inline code and nested brackets.
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def pages() -> list[Path]:
    found = [REPO / "README.md", REPO / "server" / "README.md", REPO / "ops" / "README.md"]
    found += sorted((REPO / "docs").rglob("*.md"))
    return [p for p in found if p.is_file()]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, in_fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces become hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: Counter[str] = Counter()
    found = set()
    for _, line in prose_lines(page.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def broken_links(page: Path, repo: Path = REPO) -> list[str]:
    broken = []
    for number, line in prose_lines(page.read_text()):
        for target in LINK.findall(INLINE_CODE.sub("``", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(repo)}:{number}: ({target})"
            if not resolved.exists():
                broken.append(f"{where} -> no such file {resolved}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                name = resolved.relative_to(repo.resolve())
                broken.append(f"{where} -> {name} has no heading with anchor #{anchor}")
    return broken


def test_the_pages_checked_include_the_readme_and_docs() -> None:
    names = {p.relative_to(REPO).as_posix() for p in pages()}
    assert {"README.md", "docs/architecture.md", "docs/training.md"} <= names


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = broken_links(page)
    assert broken == [], "links to fix (the file moved, or the heading was renamed):\n" + "\n".join(
        broken
    )


def test_slugs_follow_github() -> None:
    assert slug("A cost model learned from the run (`--cost-model auto`)") == (
        "a-cost-model-learned-from-the-run---cost-model-auto"
    )
    assert slug("Flags and environment") == "flags-and-environment"


def test_a_missing_file_and_a_missing_anchor_are_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Some section\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#some-section) [gone](docs/b.md) [anchor](docs/a.md#nope)\n"
        "`[in code](docs/c.md)` [web](https://example.com/x.md)\n"
        "```\n[in a fence](docs/d.md)\n```\n"
    )
    broken = broken_links(page, tmp_path)
    assert len(broken) == 2, broken
    assert "docs/b.md" in broken[0] and "#nope" in broken[1]
