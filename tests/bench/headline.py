"""README's benchmark headline, generated from docs/bench (one source, no hand copies).

    .venv/bin/python -m tests.bench.headline          # print the block
    .venv/bin/python -m tests.bench.headline --write  # put it into README.md

Each docs/bench/*.md file may hold one headline block between `<!-- headline:start -->` and
`<!-- headline:end -->` (the training benchmark writes its own; the others are kept by hand
next to the tables they quote). README.md holds their concatenation between the README markers;
tests/unit/test_bench_headline.py fails when the two differ, so a new benchmark run that changes
a figure also changes README (run this with --write).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SOURCES = ("docs/bench/training.md", "docs/bench/datapath.md")  # README order
START, END = "<!-- headline:start -->", "<!-- headline:end -->"
README_START = (
    "<!-- bench-headline:start (generated from docs/bench by `.venv/bin/python -m "
    "tests.bench.headline --write`; do not edit by hand) -->"
)
README_END = "<!-- bench-headline:end -->"


def between(text: str, start: str, end: str) -> list[str] | None:
    if start not in text or end not in text:
        return None
    return text.partition(start)[2].partition(end)[0].strip("\n").splitlines()


def block(repo: Path = REPO) -> list[str]:
    """The README block: each source's headline lines under a link to the source."""
    lines = []
    for source in SOURCES:
        found = between((repo / source).read_text(), START, END)
        if found is None:
            raise ValueError(
                f"{source} has no {START} ... {END} block: README's headline quotes it; add "
                "the block (or rerun its benchmark) and run `python -m tests.bench.headline "
                "--write`"
            )
        lines += [f"From [{source}]({source}):", "", *found, ""]
    return lines[:-1]


def readme_block(text: str) -> list[str] | None:
    return between(text, README_START, README_END)


def write(repo: Path = REPO) -> None:
    readme = repo / "README.md"
    text = readme.read_text()
    if readme_block(text) is None:
        raise ValueError(f"README.md has no {README_START} ... {README_END} markers to fill")
    head, _, rest = text.partition(README_START)
    tail = rest.partition(README_END)[2]
    readme.write_text(head + "\n".join([README_START, *block(repo), README_END]) + tail)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="headline", description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="update README.md in place")
    args = p.parse_args(argv)
    if args.write:
        write()
    else:
        print("\n".join(block()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
