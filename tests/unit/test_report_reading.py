"""The integration tests poll reports that trainer processes are still writing."""

from __future__ import annotations

from pathlib import Path

from tests.integration.harness import read_jsonl


def test_a_half_written_last_line_is_left_for_the_next_read(tmp_path: Path) -> None:
    report = tmp_path / "rank0.jsonl"
    assert read_jsonl(report) == []  # not created yet
    report.write_text('{"step": 0}\n{"step": 1}\n{"st')  # the writer is mid-line
    assert read_jsonl(report) == [{"step": 0}, {"step": 1}]
    with report.open("a") as f:
        f.write('ep": 2}\n')
    assert read_jsonl(report) == [{"step": 0}, {"step": 1}, {"step": 2}]
