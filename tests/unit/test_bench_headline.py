"""README's benchmark headline is generated from docs/bench (tests/bench/headline.py): a figure
changed in docs/bench without `python -m tests.bench.headline --write`, or edited by hand in
README, fails here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.bench import headline


def test_readme_quotes_the_docs_bench_headlines_exactly() -> None:
    readme = headline.readme_block(headline.README.read_text())
    assert readme is not None, "README.md lost its bench-headline markers"
    assert readme == headline.block(), (
        "README.md's benchmark headline differs from docs/bench: run "
        "`.venv/bin/python -m tests.bench.headline --write`"
    )


def test_the_headline_names_the_length_grouped_and_packing_baselines() -> None:
    text = "\n".join(headline.block())
    assert "group_by_length" in text and "DataCollatorWithFlattening" in text


def copy_repo(tmp_path: Path) -> Path:
    for source in (*headline.SOURCES, "README.md"):
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(headline.REPO / source, tmp_path / source)
    return tmp_path


def test_a_changed_figure_in_docs_bench_shows_as_stale_until_written(tmp_path: Path) -> None:
    repo = copy_repo(tmp_path)
    source = repo / headline.SOURCES[0]
    text = source.read_text()
    start = text.index(headline.START) + len(headline.START)
    source.write_text(text[:start] + "\n- a new figure: 9.99x" + text[start:])
    assert headline.readme_block((repo / "README.md").read_text()) != headline.block(repo)
    headline.write(repo)
    readme = headline.readme_block((repo / "README.md").read_text())
    assert readme == headline.block(repo) and "- a new figure: 9.99x" in readme


def test_a_source_without_its_block_fails_with_the_fix(tmp_path: Path) -> None:
    repo = copy_repo(tmp_path)
    source = repo / headline.SOURCES[1]
    source.write_text(source.read_text().replace(headline.START, ""))
    with pytest.raises(ValueError, match="--write"):
        headline.block(repo)
