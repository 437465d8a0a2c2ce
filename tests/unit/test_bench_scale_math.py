"""The arithmetic of tests/bench/test_bench_scale.py: histogram quantiles, metric parsing, the
per-message projection (a wrong formula would publish wrong numbers in docs/bench/scale.md)."""

from __future__ import annotations

import math

import pytest

from tests.bench.test_bench_scale import Row, buckets, parse_metrics, project, quantile

EXPOSITION = """# HELP odbd_round_duration_seconds round barrier exchange time
# TYPE odbd_round_duration_seconds histogram
odbd_round_duration_seconds_bucket{le="0.01"} 10.0
odbd_round_duration_seconds_bucket{le="0.1"} 90.0
odbd_round_duration_seconds_bucket{le="+Inf"} 100.0
odbd_round_duration_seconds_sum 4.2
odbd_rounds_total 100.0
odbd_round_payload_bytes_total{direction="sent"} 2048.0
"""


def test_metrics_are_parsed_with_their_labels():
    m = parse_metrics(EXPOSITION)
    assert m["odbd_rounds_total"] == 100.0
    assert m['odbd_round_payload_bytes_total{direction="sent"}'] == 2048.0
    assert buckets(m, "odbd_round_duration_seconds") == [
        (0.01, 10.0),
        (0.1, 90.0),
        (math.inf, 100.0),
    ]


def test_quantiles_interpolate_inside_the_bucket_as_histogram_quantile_does():
    cumulative = buckets(parse_metrics(EXPOSITION), "odbd_round_duration_seconds")
    assert quantile(0.05, cumulative) == pytest.approx(0.005)  # half of the first bucket
    assert quantile(0.5, cumulative) == pytest.approx(0.01 + 0.09 * 40 / 80)
    assert quantile(0.99, cumulative) == pytest.approx(0.1)  # in +Inf: its lower bound
    assert math.isnan(quantile(0.5, []))


def _row(nodes: int, per_result: float, cpu_per_message: float) -> Row:
    return Row(
        nodes=nodes, rounds=10, seconds=1.0, barrier_p50_ms=1.0, barrier_p99_ms=2.0,
        bytes_source="tcp", spoke_sent=100.0, spoke_received=per_result,
        hub_sent=(nodes - 1) * per_result, hub_received=(nodes - 1) * 100.0,
        planning_ms=math.nan, cpu_ms_spoke=5.0, cpu_ms_hub=2 * (nodes - 1) * cpu_per_message,
        rss_mib_max=1.0, rss_mib_mean=1.0, anon_mib_mean=1.0,
    )  # fmt: skip


def test_a_result_that_carries_every_offer_projects_quadratic_hub_bytes():
    rows = [_row(n, per_result=100.0 * n, cpu_per_message=0.5) for n in (2, 8, 32)]
    p = project(rows, 128)
    assert p.spoke_received == pytest.approx(12800.0)
    assert p.hub_sent == pytest.approx(127 * 12800.0)
    assert p.hub_received == pytest.approx(127 * 100.0)
    assert p.cpu_ms_hub == pytest.approx(2 * 127 * 0.5)
    assert p.cpu_ms_spoke == pytest.approx(5.0)


def test_constant_results_project_linear_hub_bytes():
    rows = [_row(n, per_result=300.0, cpu_per_message=0.5) for n in (2, 8)]
    assert project(rows, 1024).hub_sent == pytest.approx(1023 * 300.0)
