"""metrics/: Prometheus naming conventions, series present from the start, scrape-time rendering."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from odbd.config import DaemonConfig
from odbd.daemon.serving import is_serving
from odbd.metrics.collector import KNOWN_REJECT_REASONS, DaemonCollector
from odbd.metrics.stats import DaemonStats, Histogram
from odbd.world import World

ALLOWED_LABELS = {
    *("direction", "rank", "peer", "reason", "le", "version", "node", "term", "model"),
    "decision",  # odbd_migration_rounds_total: none, balanced, dealt
}


def render(stats: DaemonStats, live: dict[str, float] | None = None) -> str:
    registry = CollectorRegistry(auto_describe=False)  # a fresh registry per test
    registry.register(DaemonCollector(stats, lambda: live or {"shm_used_bytes": 0.0}))
    return generate_latest(registry).decode()


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def config(**overrides) -> DaemonConfig:
    args = dict(world=World(4, 2), node_rank=1, peers=("a:1", "b:2"), dataset_size=100)
    args["insecure"] = True  # peers a and b are not loopback (protected mode, issue 29)
    return DaemonConfig(**(args | overrides))


def test_names_follow_prometheus_conventions():
    stats = DaemonStats.for_config(config(epochs=3), 100)
    stats.rejected["zero_length"] += 2
    for family in families(render(stats)).values():
        assert re.fullmatch(r"odbd_[a-z0-9_]+", family.name), family.name
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith("_total"), sample.name
            assert set(sample.labels) <= ALLOWED_LABELS, sample
        if family.type == "gauge":
            assert not family.name.endswith("_total"), family.name
        assert not re.search(r"_(ms|milliseconds|kb|mb|mib|percent)$", family.name), family.name


def test_local_ranks_peers_and_reasons_are_exported_at_zero_before_any_event():
    text = render(DaemonStats.for_config(config(), 100))
    f = families(text)
    assert {s.labels["rank"] for s in f["odbd_padded_tokens"].samples} == {"2", "3"}
    assert all(s.value == 0 for s in f["odbd_padded_tokens"].samples)
    assert {s.labels["peer"] for s in f["odbd_round_last_peer"].samples} == {"0", "1"}
    reasons = {s.labels["reason"] for s in f["odbd_rejected_samples"].samples}
    assert reasons == set(KNOWN_REJECT_REASONS)


def test_job_quota_world_and_serving_gauges():
    stats = DaemonStats.for_config(config(epochs=3), 100)
    stats.serving = True
    f = families(render(stats))
    assert f["odbd_job_quota_samples"].samples[0].value == 300
    assert f["odbd_world_ranks"].samples[0].value == 4
    assert f["odbd_serving"].samples[0].value == 1
    endless = families(render(DaemonStats.for_config(config(epochs=0), 100)))
    assert endless["odbd_job_quota_samples"].samples[0].value == 0


def test_stats_render_the_values_the_hot_path_added():
    stats = DaemonStats.for_config(config(), 100)
    rank = stats.rank(2)
    rank.real_tokens, rank.padded_tokens = 750, 1000
    rank.wait_s, rank.compute_s = 0.25, 9.75
    stats.round_duration.observe(0.003)
    stats.last_peer[1] += 5
    stats.round_planning.observe(0.002)
    stats.round_traffic.sent, stats.round_traffic.received = 1234, 567
    stats.migration_rounds["dealt"] += 3
    f = families(render(stats, {"shm_used_bytes": 10.0, "shm_capacity_bytes": 20.0}))
    value = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for x in f.values() for s in x.samples
    }
    assert value[("odbd_real_tokens_total", (("rank", "2"),))] == 750
    assert value[("odbd_trainer_compute_seconds_total", (("rank", "2"),))] == 9.75
    assert value[("odbd_round_last_peer_total", (("peer", "1"),))] == 5
    assert value[("odbd_round_duration_seconds_count", ())] == 1
    assert value[("odbd_round_duration_seconds_bucket", (("le", "0.005"),))] == 1
    assert value[("odbd_round_duration_seconds_bucket", (("le", "0.0025"),))] == 0
    assert value[("odbd_shm_capacity_bytes", ())] == 20
    assert value[("odbd_round_payload_bytes_total", (("direction", "sent"),))] == 1234
    assert value[("odbd_round_payload_bytes_total", (("direction", "received"),))] == 567
    assert value[("odbd_round_planning_seconds_count", ())] == 1
    assert value[("odbd_migration_rounds_total", (("decision", "dealt"),))] == 3
    assert value[("odbd_migration_rounds_total", (("decision", "none"),))] == 0
    assert value[("odbd_round_planning_seconds_bucket", (("le", "0.0025"),))] == 1
    assert value[("odbd_round_planning_seconds_bucket", (("le", "0.001"),))] == 0


def test_each_scrape_reports_the_cpu_the_ones_before_it_cost():
    stats = DaemonStats.for_config(config(), 100)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(stats, lambda: {}))
    first = families(generate_latest(registry).decode())
    assert first["odbd_metrics_scrapes"].samples[0].value == 0
    assert first["odbd_metrics_render_cpu_seconds"].samples[0].value == 0
    after_first = stats.scrape_cpu_s
    second = families(generate_latest(registry).decode())
    assert second["odbd_metrics_scrapes"].samples[0].value == 1
    assert second["odbd_metrics_render_cpu_seconds"].samples[0].value == after_first > 0
    assert stats.scrapes == 2 and stats.scrape_cpu_s > after_first


def test_histogram_buckets_are_cumulative_and_end_in_inf():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 5.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and h.total == pytest.approx(5.65)


def test_health_is_serving_only_when_running_with_peers_and_producers():
    ok = dict(phase="running", peers_joined=True, producers=1, external_producers=False)
    assert is_serving(**ok)
    assert not is_serving(**(ok | {"producers": 0}))
    assert is_serving(**(ok | {"producers": 0, "external_producers": True}))
    assert not is_serving(**(ok | {"peers_joined": False}))
    for phase in ("starting", "draining", "done", "failed"):
        assert not is_serving(**(ok | {"phase": phase}))


def test_optimizer_updates_render_counts_and_histograms():
    stats = DaemonStats.for_config(config(), 100)
    stats.record_updates([3, 3, 1], [5000, 6000, 300])
    stats.epoch_updates = 3
    f = families(render(stats))
    value = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for x in f.values() for s in x.samples
    }
    assert value[("odbd_updates_total", ())] == 3
    assert value[("odbd_epoch_updates", ())] == 3
    assert value[("odbd_update_micro_steps_count", ())] == 3
    assert value[("odbd_update_micro_steps_bucket", (("le", "1.0"),))] == 1
    assert value[("odbd_update_tokens_sum", ())] == 11300
    assert value[("odbd_update_tokens_bucket", (("le", "4096.0"),))] == 1


def test_cost_model_families_show_the_fixed_model_until_a_fit_is_used():
    import math

    from odbd.planner.config import CostModel
    from odbd.planner.cost_fit import CostFit, FitState

    stats = DaemonStats.for_config(config(), 100)
    f = families(render(stats))
    used = {s.labels["term"]: s.value for s in f["odbd_cost_model_coefficient"].samples}
    assert used == {"tokens": 1.0, "sq": 1.2e-5, "const": 1800.0}
    assert all(math.isnan(s.value) for s in f["odbd_cost_model_fit_error"].samples)
    assert f["odbd_cost_model_learned"].samples[0].value == 0
    stats.cost_fit = CostFit(
        model=CostModel(a=1.0, b=2e-3, c=1500.0), state=FitState.FITTED,
        seconds=(2e-6, 4e-9, 3e-3), error=0.03, fixed_error=0.2, num_observations=512,
    )  # fmt: skip
    stats.cost_learned = True
    f = families(render(stats))
    used = {s.labels["term"]: s.value for s in f["odbd_cost_model_coefficient"].samples}
    fitted = {s.labels["term"]: s.value for s in f["odbd_cost_model_fitted_seconds"].samples}
    errors = {s.labels["model"]: s.value for s in f["odbd_cost_model_fit_error"].samples}
    assert used == {"tokens": 1.0, "sq": 2e-3, "const": 1500.0}
    assert fitted == {"tokens": 2e-6, "sq": 4e-9, "const": 3e-3}
    assert errors == {"fitted": 0.03, "fixed": 0.2}
    assert f["odbd_cost_model_observations"].samples[0].value == 512
    assert f["odbd_cost_model_learned"].samples[0].value == 1


def test_trained_families_count_delivered_steps_apart_from_planned_ones():
    from odbd.daemon.trained import StepCounts

    stats = DaemonStats.for_config(config(epochs=2), 100)
    before = families(render(stats))
    for name in ("odbd_delivered_samples", "odbd_delivered_loss_tokens", "odbd_trained_epochs"):
        assert [s.value for s in before[name].samples] == [0.0, 0.0], name  # ranks 2 and 3
    stats.trained.ranks[3].add(0, 0, StepCounts(5, 50, 45, 60, 9, epoch_last=True))
    stats.planned_epoch_steps, stats.planned_epoch_steps_exact = 12, True
    after = families(render(stats))

    def value(name: str, rank: str = "3") -> float:
        return next(s.value for s in after[name].samples if s.labels.get("rank") == rank)

    assert value("odbd_delivered_samples") == 5 and value("odbd_delivered_loss_tokens") == 50
    assert value("odbd_delivered_padded_tokens") == 60 and value("odbd_trained_epochs") == 1
    assert value("odbd_delivered_samples", "2") == 0
    assert after["odbd_epoch_steps_estimate"].samples[0].value == 12
    assert after["odbd_epoch_steps_exact"].samples[0].value == 1
