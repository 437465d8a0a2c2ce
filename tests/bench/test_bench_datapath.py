"""Node data path on the real daemon (DESIGN.md section 5): throughput, next() latency, overlap.

    .venv/bin/python -m pytest -q -m bench -s tests/bench/test_bench_datapath.py

"Ours" is always 1 daemon (`python -m odbd --world 1 --nproc-per-node 1 --dataset
tests/bench/datapath_dataset.py:fixed_size --workers 1`), the 1 producer it spawns and 1 trainer
process consuming with ODBClient (tests/bench/datapath_run.py): 3 busy processes on this 2-core
machine, plus the pytest parent, which only samples /proc every 50 ms. Baselines run in the same
test, interleaved with ours, so load from other work on the machine hits both alike; every
number is the median of RUNS runs. Nothing asserts speed. Results go to docs/bench/datapath.md.

1. throughput at the trainer vs the raw shm slot ring (tests/bench/shm_ring.py, 2 processes),
   8 KiB and 1 MiB samples, the trainer doing no compute. The baseline ring has 16 slots, so
   its bytes stay in cache; a second ring with as many slots as one odbd producer lane holds
   (`lane_slots`, up to 1024) shows what holding a planning buffer's bytes in flight costs
   any design (at 1 MiB: 170 MiB, far past the cache); and vs torch's DataLoader with 1 and
   2 workers, batch 16 (8 KiB) or 8 (1 MiB), over the same samples
   (tests/bench/datapath_dataloader.py, K + 1 busy processes): the peer a user would
   otherwise run (issue 15 targets: odbd >= 1.5x DataLoader(2 workers) at 8 KiB and >= 2x at
   1 MiB, >= 0.2x the 16-slot ring at 8 KiB);
2. next() latency when data is ready: the trainer computes 5-10 ms per step so its queue stays
   full; baselines: a ready queue.Queue.get() after the same compute, and a gRPC aio unary round
   trip on a unix socket (2 processes; tests/bench/datapath_baselines.py);
3. pipeline overlap compute / (compute + wait) of the same runs as 2, from the daemon's /metrics
   and from the trainer's own clock, over the steps after the first WARMUP_STEPS.
Knob: ODBD_BENCH_RUNS (default 3).
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import pytest

from tests.bench.datapath_baselines import grpc_round_trips, queue_get_latencies
from tests.bench.datapath_dataloader import DataLoaderCase, DataLoaderRun, run_dataloader
from tests.bench.datapath_run import (
    DatapathCase,
    DatapathRun,
    median,
    percentile,
    run_datapath,
)
from tests.bench.shm_ring import RingResult, run_ring

RUNS = int(os.environ.get("ODBD_BENCH_RUNS", "3"))
REPORT = Path(__file__).resolve().parents[2] / "docs" / "bench" / "datapath.md"
COMMAND = ".venv/bin/python -m pytest -q -m bench -s tests/bench/test_bench_datapath.py"
WARMUP_STEPS = 20
DATALOADER_WORKERS = (1, 2)
COMPUTE_MS = (5.0, 10.0)

# (our case, raw ring samples per run). Ring runs are short: it is 10-30x faster than ours.
THROUGHPUT_CASES = (
    (
        # The daemon's own defaults (--buffer 1024 --steps-ahead 64): what a user runs. Until
        # issue 15's third daemon pass this case was 256 / 16, four rounds per 1024 samples,
        # whose fixed cost per round then set the daemon's CPU per sample (datapath.md).
        DatapathCase(
            nbytes=8 * 1024,
            num_samples=30_000,
            batch_samples=16,
            buffer=1024,
            steps_ahead=64,
            shm_bytes=256 << 20,
            warmup_steps=WARMUP_STEPS,
        ),
        20_000,
    ),
    (
        DatapathCase(
            nbytes=1024 * 1024,
            num_samples=5_000,
            batch_samples=8,
            buffer=64,
            steps_ahead=8,
            shm_bytes=512 << 20,
            warmup_steps=WARMUP_STEPS,
        ),
        3_000,
    ),
)
LATENCY_CASE = DatapathCase(
    nbytes=8 * 1024,
    num_samples=16 * 400,  # 400 steps of 5-10 ms: ~3 s
    batch_samples=16,
    buffer=256,
    steps_ahead=16,
    shm_bytes=256 << 20,
    compute_ms=COMPUTE_MS,
    warmup_steps=WARMUP_STEPS,
    metrics=True,
)


# --- 1. throughput ----------------------------------------------------------------------------


@pytest.mark.bench
@pytest.mark.timeout(600)
def test_bench_datapath_throughput_vs_raw_ring() -> None:
    lines = [*_heading("ingest -> trainer throughput vs the raw shm slot ring")]
    lines += [
        "| sample | variant | samples/s | GB/s | vs raw ring | busy processes | CPU, fraction of "
        "a core (daemon / producer / trainer) | CPU us per sample (daemon / producer / trainer) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for case, ring_samples in THROUGHPUT_CASES:
        rings: list[RingResult] = []
        deep_rings: list[RingResult] = []
        loaders: dict[int, list[DataLoaderRun]] = {k: [] for k in DATALOADER_WORKERS}
        ours: list[DatapathRun] = []
        for _ in range(RUNS):
            rings.append(run_ring(slot_bytes=case.nbytes, num_samples=ring_samples))
            deep_rings.append(
                run_ring(
                    slot_bytes=case.nbytes, num_samples=ring_samples, num_slots=lane_slots(case)
                )
            )
            for workers, runs in loaders.items():
                runs.append(run_dataloader(dataloader_case(case, workers)))
            ours.append(run_datapath(case))
        lines += _throughput_rows(case, rings, deep_rings, ours)
        lines += _dataloader_rows(case, rings, loaders, ours)
    lines += [
        "",
        "CPU us per sample of a DataLoader row: its main (trainer) process only, all threads; "
        "its workers are not counted.",
    ]
    _finish(lines)


def dataloader_case(case: DatapathCase, num_workers: int) -> DataLoaderCase:
    """The DataLoader run over the same samples and batch size as `case`."""
    return DataLoaderCase(
        nbytes=case.nbytes,
        num_samples=case.num_samples,
        batch_samples=case.batch_samples,
        num_workers=num_workers,
        warmup_steps=case.warmup_steps,
    )


def _dataloader_rows(
    case: DatapathCase,
    rings: list[RingResult],
    loaders: dict[int, list[DataLoaderRun]],
    ours: list[DatapathRun],
) -> list[str]:
    size = f"{case.nbytes // 1024} KiB"
    ring_sps = median([r.samples_per_s for r in rings])
    ours_sps = median([r.samples_per_s for r in ours])
    rows = []
    for workers, runs in loaders.items():
        sps = median([r.samples_per_s for r in runs])
        cpu_us = median([r.main_cpu_us_per_sample for r in runs])
        # Same-run ratios, so load from other work hits both sides of each pair alike.
        pairs = ", ".join(
            f"{o.samples_per_s / d.samples_per_s:.2f}" for o, d in zip(ours, runs, strict=True)
        )
        rows += [
            f"| {size} | torch DataLoader, {workers} worker{'s' if workers > 1 else ''}, "
            f"{case.batch_samples}/batch | {sps:,.0f} | {sps * case.nbytes / 1e9:.2f} "
            f"| {sps / ring_sps:.3f}x | {workers + 1} | - | - / - / {cpu_us:.0f} |",
            f"|  | (runs: {', '.join(f'{r.samples_per_s:,.0f}' for r in runs)} samples/s; "
            f"odbd / this: {ours_sps / sps:.2f}x of the medians, {pairs} run by run) "
            "| | | | | | |",
        ]
    return rows


def lane_slots(case: DatapathCase) -> int:
    """Samples one producer lane of the odbd run holds: the daemon splits --shm-size into
    workers + 2 lanes (1 worker here); at most 1024, past which the ring loop is the cost."""
    return min(1024, case.shm_bytes // 3 // case.nbytes)


def _throughput_rows(
    case: DatapathCase,
    rings: list[RingResult],
    deep_rings: list[RingResult],
    ours: list[DatapathRun],
) -> list[str]:
    size = f"{case.nbytes // 1024} KiB"
    ring_sps = median([r.samples_per_s for r in rings])
    deep_sps = median([r.samples_per_s for r in deep_rings])
    ours_sps = median([r.samples_per_s for r in ours])
    names = ("daemon", "producer", "trainer")
    share = {n: median([r.cpu_share().get(n, 0.0) for r in ours]) for n in names}
    per_sample_us = {
        n: median([r.cpu_s.get(n, 0.0) / r.window_samples * 1e6 for r in ours]) for n in names
    }
    runs = ", ".join(f"{r.samples_per_s:,.0f}" for r in ours)
    # issue 15: the trainer process's CPU per step (its Python thread is a GPU job's scarcest)
    trainer_step_us = median(
        [
            r.cpu_s.get("trainer", 0.0) / (len(r.num_samples) - case.warmup_steps - 1) * 1e6
            for r in ours
        ]
    )
    return [
        f"| {size} | raw ring (eventfd), 16 slots | {ring_sps:,.0f} "
        f"| {ring_sps * case.nbytes / 1e9:.2f} | 1.00x | 2 | - | - |",
        f"| {size} | raw ring, {lane_slots(case)} slots (one odbd lane) | {deep_sps:,.0f} "
        f"| {deep_sps * case.nbytes / 1e9:.2f} | {deep_sps / ring_sps:.3f}x | 2 | - | - |",
        f"| {size} | odbd, {case.batch_samples}/batch | {ours_sps:,.0f} "
        f"| {ours_sps * case.nbytes / 1e9:.2f} | {ours_sps / ring_sps:.3f}x | 3 "
        f"| {' / '.join(f'{share[n]:.2f}' for n in names)} "
        f"| {' / '.join(f'{per_sample_us[n]:.0f}' for n in names)} |",
        f"|  | (odbd runs: {runs} samples/s; {ours_sps / deep_sps:.3f}x the "
        f"{lane_slots(case)}-slot ring; trainer process CPU {trainer_step_us:.0f} us per step) "
        "| | | | | | |",
    ]


# --- 2. next() latency and 3. overlap ---------------------------------------------------------


@pytest.mark.bench
@pytest.mark.timeout(600)
def test_bench_next_latency_and_pipeline_overlap() -> None:
    queue_runs, grpc_runs, ours = [], [], []
    for _ in range(RUNS):
        queue_runs.append(queue_get_latencies(200, COMPUTE_MS))
        grpc_runs.append(grpc_round_trips(2000))
        ours.append(run_datapath(LATENCY_CASE))
    lines = [*_heading("trainer next() latency with data ready, and pipeline overlap")]
    lines += [
        f"Trainer compute: uniform {COMPUTE_MS[0]:g}-{COMPUTE_MS[1]:g} ms per step (time.sleep), "
        f"{LATENCY_CASE.batch_samples} x {LATENCY_CASE.nbytes // 1024} KiB samples per batch, "
        f"{LATENCY_CASE.num_samples // LATENCY_CASE.batch_samples} steps per run; the first "
        f"{WARMUP_STEPS + 1} steps (connect, first round, queue filling) are left out. "
        "Percentiles: per run, then the median over runs; max: over all runs.",
        "",
        "| what | processes | p50 ms | p90 ms | p99 ms | max ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        _latency_row("queue.Queue.get() of a ready object, after the same compute", 1, queue_runs),
        _latency_row("gRPC aio unary round trip, unix socket (health Check)", 2, grpc_runs),
        _latency_row("ODBClient next(), steady state", 3, [r.steady_wait_s for r in ours]),
        "",
        "Pipeline overlap = compute / (compute + wait) over the same steps, from the trainer's "
        "clock and from the daemon's /metrics (difference of odbd_trainer_compute_seconds_total "
        "and odbd_trainer_wait_seconds_total scraped after step "
        f"{WARMUP_STEPS} and after the epoch):",
        "",
        "| run | steps measured | overlap (trainer clock) | overlap (daemon /metrics) "
        "| mean wait ms | CPU, fraction of a core (daemon / producer / trainer) |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for index, run in enumerate(ours):
        lines.append(_overlap_row(str(index + 1), run))
    lines.append(
        f"| median | | {median([r.trainer_overlap for r in ours]):.4f} "
        f"| {median([r.daemon_overlap or 0.0 for r in ours]):.4f} | | |"
    )
    _finish(lines)


def _latency_row(what: str, processes: int, runs: list[list[float]]) -> str:
    cells = [median([percentile(r, q) * 1e3 for r in runs]) for q in (50, 90, 99)]
    worst = max(max(r) for r in runs) * 1e3
    return f"| {what} | {processes} | " + " | ".join(f"{c:.3f}" for c in [*cells, worst]) + " |"


def _overlap_row(name: str, run: DatapathRun) -> str:
    waits = run.steady_wait_s
    share = run.cpu_share()
    cpu = " / ".join(f"{share.get(n, 0.0):.2f}" for n in ("daemon", "producer", "trainer"))
    daemon = f"{run.daemon_overlap:.4f}" if run.daemon_overlap is not None else "n/a"
    return (
        f"| {name} | {len(waits)} | {run.trainer_overlap:.4f} | {daemon} "
        f"| {sum(waits) / len(waits) * 1e3:.3f} | {cpu} |"
    )


# --- report -----------------------------------------------------------------------------------


def _heading(title: str) -> list[str]:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return [
        "",
        f"## {when}, commit {_git_revision()}: {title}",
        "",
        f"`{COMMAND}`; {os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}, kernel {platform.release()}; load average at start "
        f"{load} (other work shares this machine); median of {RUNS} interleaved runs.",
        "",
    ]


def _finish(lines: list[str]) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines += ["", f"Load average at the end: {load}.", ""]
    print("\n" + "\n".join(lines))
    with REPORT.open("a") as report:
        report.write("\n".join(lines) + "\n")


def _git_revision() -> str:
    result = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() or "unknown"


def test_percentile_is_nearest_rank() -> None:
    # Not a benchmark: guards the helper the tables rely on (runs in the default selection).
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0


@pytest.mark.bench
def test_bench_collation_cost_per_sample_by_batch_form() -> None:
    """Issue 13: packed and multimodal collation against the padded path, same run."""
    from tests.bench.collate_cost import BATCH, measure

    num_samples = 4096
    rows = measure(num_samples, RUNS)
    lines = _heading("trainer-side collation cost per sample by batch form (issue 13)")
    lines += [
        f"`odbclient.trainer.collate.collate` on batches of {BATCH} samples decoded as zero-copy "
        f"views of the shm layout (tests/bench/collate_cost.py), {num_samples} samples per form, "
        "one process; the padded path of the same data is the baseline.",
        "",
        "| batch form | us per sample | vs padded baseline |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {name} | {us:.2f} | {ratio:.2f}x |" for name, us, ratio in rows]
    _finish(lines)
