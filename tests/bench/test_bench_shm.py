"""Raw shm slot ring (the DESIGN.md section 5 data-path baseline) vs odbd's arena + sample layout.

Run: `.venv/bin/python -m pytest -q -m bench -s tests/bench/test_bench_shm.py`. Each
measurement runs 2 processes (pytest as consumer, one producer child); results are appended
to docs/bench/shm.md. Nothing here asserts speed: it prints ratios measured in the same run.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import pytest

from tests.bench.shm_ring import RingResult, default_notify, memcpy_gb_per_s, run_ring

RUNS = 5
CASES = [(8 * 1024, 20_000), (1024 * 1024, 2_000)]  # (slot bytes, samples per run)
REPORT = Path(__file__).resolve().parents[2] / "docs" / "bench" / "shm.md"
COMMAND = ".venv/bin/python -m pytest -q -m bench -s tests/bench/test_bench_shm.py"


def median_run(runs: list[RingResult]) -> RingResult:
    return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]


def measure(slot_bytes: int, num_samples: int) -> dict[str, RingResult]:
    """Median of RUNS runs per variant; variants interleave so drift hits all of them alike."""
    runs: dict[str, list[RingResult]] = {"raw": [], "arena": [], "raw-pipe": []}
    for _ in range(RUNS):
        runs["raw"].append(run_ring(slot_bytes=slot_bytes, num_samples=num_samples))
        runs["arena"].append(run_ring(slot_bytes=slot_bytes, num_samples=num_samples, mode="arena"))
        if default_notify() == "eventfd":
            runs["raw-pipe"].append(
                run_ring(slot_bytes=slot_bytes, num_samples=num_samples, notify="pipe")
            )
    return {name: median_run(results) for name, results in runs.items() if results}


def table(results: dict[int, dict[str, RingResult]]) -> list[str]:
    lines = [
        "| slot | variant | notify | samples/s | GB/s | vs raw ring |",
        "| ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for slot_bytes, variants in results.items():
        raw = variants["raw"]
        for name, r in variants.items():
            lines.append(
                f"| {slot_bytes // 1024} KiB | {name.removesuffix('-pipe')} | {r.notify} "
                f"| {r.samples_per_s:,.0f} | {r.gb_per_s:.2f} "
                f"| {r.samples_per_s / raw.samples_per_s:.2f}x |"
            )
    return lines


def git_revision() -> str:
    result = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() or "unknown"


@pytest.mark.bench
@pytest.mark.timeout(900)
def test_bench_arena_vs_raw_shm_ring() -> None:
    results = {slot_bytes: measure(slot_bytes, n) for slot_bytes, n in CASES}
    memcpy = {slot_bytes: memcpy_gb_per_s(slot_bytes) for slot_bytes, _ in CASES}
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "",
        f"## {when}, commit {git_revision()}",
        "",
        f"`{COMMAND}`; {os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}, kernel {platform.release()}. Every run: 2 processes "
        f"(pytest consumer + 1 producer child), 16 slots; median of {RUNS} interleaved runs.",
        "Single-process memcpy (np.copyto through 64 MiB, out of cache): "
        + ", ".join(f"{gbps:.1f} GB/s at {size // 1024} KiB" for size, gbps in memcpy.items()),
        "",
        *table(results),
        "",
    ]
    print("\n" + "\n".join(lines))
    with REPORT.open("a") as report:
        report.write("\n".join(lines) + "\n")
