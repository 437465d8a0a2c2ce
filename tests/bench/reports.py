"""How a benchmark adds its run to its docs/bench report (shared by the bench tests)."""

from __future__ import annotations

import datetime
from pathlib import Path


def run_stamp() -> str:
    """The heading time of a run's section, in UTC."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def append_to_report(report: Path, intro: str, lines: list[str]) -> None:
    """Appends a run's `lines` to `report`; a new report starts with `intro` (its title and
    method), so every later run adds one section below the same explanation."""
    report.parent.mkdir(parents=True, exist_ok=True)
    if not report.exists():
        report.write_text(intro)
    with report.open("a") as out:
        out.write("\n".join(lines) + "\n")
