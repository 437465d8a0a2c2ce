"""One Prometheus collector rendering DaemonStats and live gauges at scrape time.

Names follow Prometheus conventions: prefix odbd_, base units, counters end in _total, labels
limited to rank, peer and reason, plus the closed sets term and model of the cost model
families. The three numbers an operator reads first, with their PromQL, are in ops/README.md
(padding, pipeline overlap, sample quota); ops/grafana/ and ops/prometheus/ use only the
names below, which a test checks against a live scrape. Per-rank families carry `rank`; every
daemon reports the job-wide numbers (global_*, epoch_*, job_*, round_*, cost_model_*)
identically, so job views take max() over the daemons rather than sum().
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from odbclient.samples import RejectReason
from odbd.ingest.rejections import PRODUCER_CRASH
from odbd.metrics.stats import MIGRATION_DECISIONS, DaemonStats

VERSION = "0.1.0"
# Exported at 0 from the start, so the first rejection is an increase() and alerts see it.
# The daemon adds zero_length, schema_mismatch and producer_crash (an id that killed producers).
KNOWN_REJECT_REASONS = (
    "zero_length",
    "schema_mismatch",
    PRODUCER_CRASH,
    *(r.value for r in RejectReason),
)


class DaemonCollector(Collector):
    def __init__(self, stats: DaemonStats, live: Callable[[], dict[str, float]]) -> None:
        self._stats = stats
        self._live = live  # buffered, leased, shm bytes...: read when scraped

    def collect(self) -> Iterator[Metric]:
        # Thread CPU time from the first family to the last: prometheus_client formats each
        # family as it is yielded, so this is the scrape's cost to the daemon (all but the
        # last family's formatting), reported from the next scrape on.
        started = time.thread_time()
        yield from self._families(self._stats)
        self._stats.scrapes += 1
        self._stats.scrape_cpu_s += time.thread_time() - started

    def _families(self, s: DaemonStats) -> Iterator[Metric]:
        info = GaugeMetricFamily("odbd_build_info", "odbd build", labels=["version", "node"])
        info.add_metric([VERSION, str(s.node_rank)], 1)
        yield info
        yield from self._rank_families(s)
        yield from _trained_families(s)
        yield from self._global_families(s)
        yield from self._ingest_families(s)
        yield from _cost_model_families(s)
        for name, value in self._live().items():
            yield GaugeMetricFamily(f"odbd_{name}", _LIVE_HELP.get(name, name), value=value)
        yield from _counters(
            ("metrics_scrapes", "scrapes of /metrics rendered", s.scrapes),
            (
                "metrics_render_cpu_seconds",
                "CPU time the daemon spent rendering /metrics (its overhead: rate() / cores used)",
                s.scrape_cpu_s,
            ),
        )

    def _rank_families(self, s: DaemonStats) -> Iterator[Metric]:
        fields = (
            ("steps_total", "steps planned for the rank (queued or delivered)", "steps"),
            ("idle_steps_total", "alignment fillers planned for the rank", "idle_steps"),
            ("emitted_samples_total", "samples planned for the rank", "samples"),
            ("real_tokens_total", "real (unpadded) tokens planned", "real_tokens"),
            ("padded_tokens_total", "padded tokens (max length x count) planned", "padded_tokens"),
            ("loss_tokens_total", "loss-bearing tokens planned", "loss_tokens"),
            ("trainer_wait_seconds_total", "time the trainer blocked in next()", "wait_s"),
            ("trainer_compute_seconds_total", "time the trainer spent between next()", "compute_s"),
            ("delivered_steps_total", "steps the trainer acknowledged", "delivered_steps"),
        )
        for suffix, help_text, attr in fields:
            family = CounterMetricFamily(
                f"odbd_{suffix.removesuffix('_total')}", help_text, labels=["rank"]
            )
            for rank, rs in sorted(s.ranks.items()):
                family.add_metric([str(rank)], getattr(rs, attr))
            yield family

    def _global_families(self, s: DaemonStats) -> Iterator[Metric]:
        counters = (
            ("global_steps", "aligned steps planned (every rank runs each)", s.global_steps),
            ("global_samples", "samples planned over every rank", s.global_samples),
            ("global_tokens", "loss tokens planned over every rank", s.global_tokens),
            ("step_max_work", "sum over steps of the slowest rank's cost", s.step_max_work),
            ("step_mean_work", "sum over steps of the mean rank cost", s.step_mean_work),
            ("rounds", "alignment rounds completed", s.rounds),
            ("alignment_splits", "groups split to reach a round's step count", s.splits),
            ("recirculated_samples", "samples returned to the buffer by alignment", s.recirculated),
            (
                "epochs",
                "epochs planned in full (trained: odbd_trained_epochs_total)",
                s.epochs_done,
            ),
            (
                "updates",
                "optimizer updates planned (--accumulate / --tokens-per-update)",
                s.updates,
            ),
        )
        yield from _counters(*counters)
        yield GaugeMetricFamily(
            "odbd_epoch_updates",
            "optimizer updates planned in the epoch planned last (all of it once it ended)",
            value=s.epoch_updates,
        )
        for name, help_text, h in (
            ("odbd_update_tokens", "loss-bearing tokens per optimizer update", s.update_tokens),
            ("odbd_update_micro_steps", "micro-steps per optimizer update", s.update_steps),
        ):
            family = HistogramMetricFamily(name, help_text)
            family.add_metric([], h.cumulative(), sum_value=h.total)
            yield family
        yield GaugeMetricFamily(
            "odbd_epoch",
            "epoch being planned, ahead of training by the queued steps (odbd_trained_epoch)",
            value=s.epoch,
        )
        yield GaugeMetricFamily(
            "odbd_epoch_steps_estimate",
            "steps of the epoch planned last, as estimated from the steps planned so far",
            value=s.planned_epoch_steps,
        )
        yield GaugeMetricFamily(
            "odbd_epoch_steps_exact",
            "1 once odbd_epoch_steps_estimate is exact (the epoch's last step is planned)",
            value=int(s.planned_epoch_steps_exact),
        )
        yield GaugeMetricFamily(
            "odbd_job_quota_samples",
            "samples the job emits in all: epochs x N (0 = endless)",
            value=s.epochs * s.dataset_size,
        )
        yield GaugeMetricFamily("odbd_world_ranks", "trainer ranks in the job", value=s.world_size)
        yield GaugeMetricFamily(
            "odbd_serving", "1 when grpc.health.v1 reports SERVING", value=int(s.serving)
        )
        yield GaugeMetricFamily(
            "odbd_epoch_quota_samples", "samples per epoch (dataset size N)", value=s.dataset_size
        )
        yield GaugeMetricFamily(
            "odbd_epoch_emitted_samples",
            "samples planned this epoch, every rank (trained: odbd_delivered_samples_total)",
            value=s.epoch_samples,
        )
        yield GaugeMetricFamily(
            "odbd_epoch_identities_covered",
            "distinct dataset identities emitted this epoch over every node (the same on every "
            "daemon; EpochEnd.num_identities)",
            value=s.epoch_identities,
        )
        hist = HistogramMetricFamily("odbd_round_duration_seconds", "round barrier exchange time")
        hist.add_metric([], s.round_duration.cumulative(), sum_value=s.round_duration.total)
        yield hist
        planning = HistogramMetricFamily(
            "odbd_round_planning_seconds",
            "this daemon's time planning each round after its exchange (its own node's share)",
        )
        planning.add_metric([], s.round_planning.cumulative(), sum_value=s.round_planning.total)
        yield planning
        traffic = CounterMetricFamily(
            "odbd_round_payload_bytes",
            "bytes of round messages (contributions, results) over this daemon's peer streams",
            labels=["direction"],
        )
        traffic.add_metric(["sent"], s.round_traffic.sent)
        traffic.add_metric(["received"], s.round_traffic.received)
        yield traffic
        last = CounterMetricFamily(
            "odbd_round_last_peer",
            "rounds in which this peer's offer arrived last",
            labels=["peer"],
        )
        for node in sorted(set(range(s.num_nodes)) | set(s.last_peer)):
            last.add_metric([str(node)], s.last_peer[node])
        yield last

    def _ingest_families(self, s: DaemonStats) -> Iterator[Metric]:
        yield from _counters(
            ("ingest_samples", "samples committed", s.ingest_samples),
            ("ingest_bytes", "sample bytes committed", s.ingest_bytes),
            ("expired_leases", "leases re-leased", s.expired_leases),
            (
                "lanes_full_rounds",
                "rounds offered with a partial buffer because every producer waited for lane "
                "space (raise --shm-size)",
                s.lanes_full_rounds,
            ),
            ("producer_restarts", "producer processes restarted", s.producers_restarted),
            (
                "oversized_samples",
                "samples longer than --token-budget or with more patches than --max-patches, each "
                "trained alone in its own group (raise the budget or truncate in preprocessing)",
                s.oversized_samples,
            ),
        )
        for name, what, out, into in (
            (
                "odbd_migrated_bytes",
                "payload bytes of samples moved between nodes (--migrate auto)",
                s.migrated_out_bytes,
                s.migrated_in_bytes,
            ),
            (
                "odbd_migrated_samples",
                "samples moved between nodes (--migrate auto)",
                s.migrated_out_samples,
                s.migrated_in_samples,
            ),
        ):
            moved = CounterMetricFamily(name, what, labels=["direction"])
            moved.add_metric(["out"], out)
            moved.add_metric(["in"], into)
            yield moved
        decided = CounterMetricFamily(
            "odbd_migration_rounds",
            "rounds by the hub's moves decision (--migrate auto): none (no sample moved), "
            "balanced (cost levels evened across nodes) or dealt (the world's groups dealt)",
            labels=["decision"],
        )
        for decision in MIGRATION_DECISIONS:
            decided.add_metric([decision], s.migration_rounds[decision])
        yield decided
        rejected = CounterMetricFamily(
            "odbd_rejected_samples", "samples rejected at ingest", labels=["reason"]
        )
        for reason in sorted(set(KNOWN_REJECT_REASONS) | set(s.rejected)):
            rejected.add_metric([reason], s.rejected[reason])
        yield rejected


_TRAINED = (
    # (name without odbd_, type, help, RankTrained attribute)
    ("delivered_samples", "counter", "samples in the steps the trainer took", "samples"),
    ("delivered_loss_tokens", "counter", "loss-bearing tokens the trainer took", "loss_tokens"),
    ("delivered_real_tokens", "counter", "real (unpadded) tokens the trainer took", "real_tokens"),
    (
        "delivered_padded_tokens",
        "counter",
        "padded tokens the trainer took (1 - real / padded: its padding)",
        "padded_tokens",
    ),
    ("trained_epochs", "counter", "epochs whose last step the trainer took", "epochs_trained"),
    ("trained_epoch", "gauge", "epoch of the newest step the trainer took", "epoch"),
    (
        "trained_epoch_steps",
        "gauge",
        "steps of odbd_trained_epoch up to the newest the trainer took",
        "epoch_steps",
    ),
)


def _trained_families(s: DaemonStats) -> Iterator[Metric]:
    """Per local rank, what its trainer took (daemon/trained.py), apart from the planned
    families above: the queue holds up to --steps-ahead planned steps between the two."""
    for name, kind, help_text, attr in _TRAINED:
        family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = family_type(f"odbd_{name}", help_text, labels=["rank"])
        for rank, trained in sorted(s.trained.ranks.items()):
            family.add_metric([str(rank)], getattr(trained, attr))
        yield family


COST_TERMS = ("tokens", "sq", "const")  # a per padded token, b per squared length, c per step


def _cost_model_families(s: DaemonStats) -> Iterator[Metric]:
    """The planner's cost model (planner/cost_fit.py); the same on every daemon."""
    fit = s.cost_fit
    used = (fit.model.a, fit.model.b, fit.model.c) if fit and s.cost_learned else None
    coefficient = GaugeMetricFamily(
        "odbd_cost_model_coefficient",
        "the planner's step cost c + max_r(a*padded + b*sum l^2) in token-equivalents (a = 1 "
        "once learned): term tokens = a, sq = b, const = c",
        labels=["term"],
    )
    fitted = GaugeMetricFamily(
        "odbd_cost_model_fitted_seconds",
        "the fit of rank-step compute time: seconds per padded token (tokens), per squared "
        "length (sq), per step (const); 0 before the first fit",
        labels=["term"],
    )
    seconds = fit.seconds if fit else (0.0, 0.0, 0.0)
    for term, used_value, fit_value in zip(
        COST_TERMS, used or _fixed_coefficients(s), seconds, strict=True
    ):
        coefficient.add_metric([term], used_value)
        fitted.add_metric([term], fit_value)
    yield coefficient
    yield fitted
    error = GaugeMetricFamily(
        "odbd_cost_model_fit_error",
        "median |predicted - measured| / measured rank-step time over the fit's window: the "
        "fitted model, and the fixed one at its best single scale (NaN before a fit)",
        labels=["model"],
    )
    error.add_metric(["fitted"], fit.error if fit else math.nan)
    error.add_metric(["fixed"], fit.fixed_error if fit else math.nan)
    yield error
    yield GaugeMetricFamily(
        "odbd_cost_model_observations",
        "timed rank-steps in the cost model fit's window",
        value=fit.num_observations if fit else 0,
    )
    yield GaugeMetricFamily(
        "odbd_cost_model_learned",
        "1 while the planner uses the fitted cost model (--cost-model auto after warm-up)",
        value=int(s.cost_learned),
    )


def _fixed_coefficients(s: DaemonStats) -> tuple[float, float, float]:
    fixed = s.fixed_cost
    return (fixed.a, fixed.b, fixed.c)


def _counters(*rows: tuple[str, str, float]) -> Iterator[Metric]:
    """One unlabelled counter family per (name without odbd_ and _total, help, value)."""
    for name, help_text, value in rows:
        yield CounterMetricFamily(f"odbd_{name}", help_text, value=value)


_LIVE_HELP = {
    "buffered_samples": "samples buffered for the next round",
    "leased_samples": "sample ids leased to producers, not yet committed",
    "queued_steps": "planned steps not yet delivered, summed over local ranks",
    "shm_used_bytes": "shared-memory arena bytes in use",
    "shm_capacity_bytes": "shared-memory arena capacity",
    "producers": "connected producers",
    "producers_lane_full": "producers waiting for room in their shared-memory lane",
    "trainers": "attached trainer clients",
}
