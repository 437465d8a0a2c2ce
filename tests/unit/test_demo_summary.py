"""The demo's closing table: every value starts in one column, shared memory included."""

from __future__ import annotations

from odbd.demo.summary import DemoSummary, render


def summary() -> DemoSummary:
    return DemoSummary(
        steps_per_rank={0: 75, 1: 75},
        idle_steps=0,
        padding_ratio=0.0446,
        samples_per_step=53.3,
        identities_covered=4000,
        dataset_size=4000,
        duplicates=0,
        rejected={},
        simulated_time=1.0,
        fixed_time=3.95,
        speedup=3.95,
    )


def test_every_row_s_value_starts_in_the_same_column() -> None:
    for shm_left, shown in (([], "none"), (["odbd-j-0-0", "odbd-j-1-0"], "odbd-j-0-0, odbd-j-1-0")):
        lines = render(summary(), ["http://127.0.0.1:1/metrics"], shm_left).splitlines()
        columns = {len(line) - len(line[2:].split("  ", 1)[1].lstrip()) for line in lines}
        assert len(columns) == 1, lines
        assert lines[-1].split()[:3] == ["shared", "memory", "left"], lines
        assert lines[-1].endswith(shown)
        assert "75 (equal)" in lines[0]
