"""Writes ops/grafana/odbd-dashboard.json: one row per stage, in data-path order.

    python ops/grafana/generate.py          # rewrite the JSON
    python ops/grafana/generate.py --check  # exit 1 if the committed JSON is out of date

The PromQL lives here once; tests/unit/test_ops_grafana.py checks the JSON against this file and
every expression against a live daemon's /metrics, and tests/integration/test_prometheus.py
evaluates the padding, overlap and quota expressions in a real Prometheus.
Variables: $job (the Prometheus job label of the daemons) and Grafana's $__rate_interval.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("odbd-dashboard.json")
J = '{job=~"$job"}'
RI = "[$__rate_interval]"


def rate(metric: str, by: str = "") -> str:
    inner = f"rate({metric}{J}{RI})"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


# The three numbers an operator reads first (ops/README.md), cumulative over the job so far.
PADDING = f"1 - sum(odbd_real_tokens_total{J}) / sum(odbd_padded_tokens_total{J})"
OVERLAP = (
    f"sum(odbd_trainer_compute_seconds_total{J}) / (sum(odbd_trainer_compute_seconds_total{J})"
    f" + sum(odbd_trainer_wait_seconds_total{J}))"
)
QUOTA = f"max(odbd_global_samples_total{J}) / max(odbd_job_quota_samples{J} > 0)"
# The same, now (rate windows), per job and per rank.
PADDING_NOW = f"1 - {rate('odbd_real_tokens_total')} / {rate('odbd_padded_tokens_total')}"
PADDING_RANK = (
    f"1 - {rate('odbd_real_tokens_total', 'rank')} / {rate('odbd_padded_tokens_total', 'rank')}"
)
OVERLAP_NOW = (
    f"{rate('odbd_trainer_compute_seconds_total')} / ({rate('odbd_trainer_compute_seconds_total')}"
    f" + {rate('odbd_trainer_wait_seconds_total')})"
)
OVERLAP_RANK = (
    f"{rate('odbd_trainer_compute_seconds_total', 'rank')} / "
    f"({rate('odbd_trainer_compute_seconds_total', 'rank')} + "
    f"{rate('odbd_trainer_wait_seconds_total', 'rank')})"
)
QUOTA_RANK = (
    f"sum by (rank) (odbd_emitted_samples_total{J}) / scalar("
    f"max(odbd_job_quota_samples{J} > 0) / max(odbd_world_ranks{J}))"
)
# What the trainers took (delivered steps), against the planned quota above: the planner runs
# up to --steps-ahead steps ahead of training. Every rank counts its own samples, hence sum().
QUOTA_TRAINED = f"sum(odbd_delivered_samples_total{J}) / max(odbd_job_quota_samples{J} > 0)"
EPOCH_PROGRESS = f"max(odbd_epoch_emitted_samples{J}) / max(odbd_epoch_quota_samples{J} > 0)"
EPOCH_COVERAGE = f"max(odbd_epoch_identities_covered{J}) / max(odbd_epoch_quota_samples{J} > 0)"

_GREEN, _YELLOW, _RED = "green", "yellow", "red"


def thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"value": v, "color": c} for v, c in steps]}


LOW_IS_GOOD = thresholds((None, _GREEN), (0.05, _YELLOW), (0.15, _RED))  # padding
HIGH_IS_GOOD = thresholds((None, _RED), (0.95, _YELLOW), (0.99, _GREEN))  # overlap
NEUTRAL = thresholds((None, "blue"))


class Board:
    """Accumulates rows and panels on Grafana's 24-column grid."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        self._new_line()
        self.panels.append(self._panel("row", title, w=24, h=1) | {"collapsed": False})
        self.y += 1

    def stat(self, title: str, expr: str, unit: str, steps: dict[str, Any], desc: str) -> None:
        panel = self._panel("stat", title, w=6, h=5)
        panel |= _targets((expr, title))
        panel["description"] = desc
        panel["fieldConfig"] = _field(unit, steps)
        panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background"}
        self._place(panel)

    def series(
        self,
        title: str,
        targets: list[tuple[str, str]],
        unit: str,
        desc: str,
        steps: dict[str, Any] = NEUTRAL,
        w: int = 8,
    ) -> None:
        panel = self._panel("timeseries", title, w=w, h=8) | _targets(*targets)
        panel["description"] = desc
        panel["fieldConfig"] = _field(unit, steps)
        if steps is not NEUTRAL:
            panel["fieldConfig"]["defaults"]["custom"] = {"thresholdsStyle": {"mode": "line"}}
        self._place(panel)

    def _panel(self, kind: str, title: str, w: int, h: int) -> dict[str, Any]:
        panel = {"id": self.next_id, "type": kind, "title": title}
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": w, "h": h}
        panel["datasource"] = {"type": "prometheus", "uid": "${datasource}"}
        self.next_id += 1
        return panel

    def _place(self, panel: dict[str, Any]) -> None:
        w, h = panel["gridPos"]["w"], panel["gridPos"]["h"]
        if self.x + w > 24:
            self._new_line()
        panel["gridPos"] |= {"x": self.x, "y": self.y}
        self.x += w
        self._line_height = max(getattr(self, "_line_height", 0), h)
        self.panels.append(panel)

    def _new_line(self) -> None:
        if self.x:
            self.y += getattr(self, "_line_height", 0)
        self.x, self._line_height = 0, 0


def _targets(*targets: tuple[str, str]) -> dict[str, Any]:
    return {
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ]
    }


def _field(unit: str, steps: dict[str, Any]) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit, "thresholds": steps, "color": {"mode": "thresholds"}}
    if unit == "percentunit":
        defaults |= {"min": 0, "max": 1}
    if steps is NEUTRAL:
        defaults["color"] = {"mode": "palette-classic"}
    return {"defaults": defaults, "overrides": []}


def overview(b: Board) -> None:
    b.row("Overview: padding, overlap, quota")
    b.stat(
        "Padding (job)",
        PADDING,
        "percentunit",
        LOW_IS_GOOD,
        "Share of padded tokens that are padding, since the daemons started. Lower is better.",
    )
    b.stat(
        "Pipeline overlap (job)",
        OVERLAP,
        "percentunit",
        HIGH_IS_GOOD,
        "Trainer time spent computing rather than waiting in next(). Below 95 %: data-bound.",
    )
    b.stat(
        "Sample quota (job)",
        QUOTA,
        "percentunit",
        NEUTRAL,
        "Samples emitted / (epochs x N). Join mode ends slightly above 100 % (sampler tail).",
    )
    b.stat(
        "Daemons serving",
        f"sum(odbd_serving{J})",
        "none",
        thresholds((None, _RED), (1, _GREEN)),
        "Daemons whose grpc.health.v1 reports SERVING (peers joined, producers attached).",
    )


def ingest(b: Board) -> None:
    b.row("1. Ingest: producers -> shared memory")
    b.series(
        "Samples committed / s",
        [(rate("odbd_ingest_samples_total", "instance"), "{{instance}}")],
        "short",
        "Samples producers wrote into shared memory.",
    )
    b.series(
        "Ingest bytes / s",
        [(rate("odbd_ingest_bytes_total", "instance"), "{{instance}}")],
        "Bps",
        "Sample bytes committed into the arena.",
    )
    b.series(
        "Shared memory used",
        [(f"odbd_shm_used_bytes{J} / odbd_shm_capacity_bytes{J}", "{{instance}}")],
        "percentunit",
        "Arena use. Near 100 % with no ingest: trainers are not freeing batches, raise --shm-size.",
        thresholds((None, _GREEN), (0.85, _YELLOW), (0.95, _RED)),
    )
    b.series(
        "Buffered and leased samples",
        [
            (f"odbd_buffered_samples{J}", "buffered {{instance}}"),
            (f"odbd_leased_samples{J}", "leased {{instance}}"),
        ],
        "short",
        "Samples waiting for the next round, and ids in producers' hands.",
    )
    b.series(
        "Rejected samples / s",
        [
            (rate("odbd_rejected_samples_total", "reason"), "{{reason}}"),
            (rate("odbd_oversized_samples_total"), "over --token-budget (trained alone)"),
        ],
        "short",
        "Samples producers could not make, by reason (see the daemon log for details; "
        "docs/datasets.md lists the reasons). Over --token-budget: samples trained alone in "
        "a step larger than the budget (not rejected).",
    )
    b.series(
        "Producers, restarts, expired leases, full lanes",
        [
            (f"sum(odbd_producers{J})", "producers"),
            (f"sum(odbd_producers_lane_full{J})", "waiting for lane space"),
            (f"sum(increase(odbd_producer_restarts_total{J}{RI}))", "restarts"),
            (f"sum(increase(odbd_expired_leases_total{J}{RI}))", "expired leases"),
            (f"sum(increase(odbd_lanes_full_rounds_total{J}{RI}))", "rounds on full lanes"),
        ],
        "short",
        "Connected producers and those waiting for room in their shm lane (backpressure); "
        "restarts and expired leases mean producers are dying. Rounds on full lanes: "
        "--shm-size is too small for --buffer, rounds run short.",
    )


def planning(b: Board) -> None:
    b.row("2. Planning: grouping and padding")
    b.series(
        "Padding ratio",
        [(PADDING_NOW, "job"), (PADDING_RANK, "rank {{rank}}")],
        "percentunit",
        "1 - real / padded tokens over the rate window, job and per rank.",
        LOW_IS_GOOD,
    )
    b.series(
        "Samples and tokens per step",
        [
            (
                f"{rate('odbd_global_samples_total')} / {rate('odbd_global_steps_total')}",
                "samples / step",
            ),
            (
                f"{rate('odbd_global_tokens_total')} / {rate('odbd_global_steps_total')}",
                "loss tokens / step",
            ),
        ],
        "short",
        "Over every rank (every daemon reports the same job-wide numbers; one is shown).",
    )
    b.series(
        "Idle steps (alignment fillers) / s",
        [(rate("odbd_idle_steps_total", "rank"), "rank {{rank}}")],
        "short",
        "Steps a rank ran with no samples so every rank runs the same number of steps.",
    )
    b.series(
        "Optimizer updates: tokens and micro-steps per update",
        [
            (
                f"{rate('odbd_update_tokens_sum')} / {rate('odbd_update_tokens_count')}",
                "loss tokens / update",
            ),
            (
                f"{rate('odbd_update_micro_steps_sum')} / {rate('odbd_update_micro_steps_count')}",
                "micro-steps / update",
            ),
        ],
        "short",
        "With --accumulate K or --tokens-per-update T (empty otherwise): every rank's loss "
        "tokens and the micro-steps of each optimizer update.",
    )
    b.series(
        "Cost model: fit error and whether it is used",
        [
            ('max(odbd_cost_model_fit_error{job=~"$job",model="fitted"})', "fitted model error"),
            ('max(odbd_cost_model_fit_error{job=~"$job",model="fixed"})', "fixed model error"),
            (f"max(odbd_cost_model_learned{J})", "learned model in use"),
        ],
        "percentunit",
        "Median relative error of predicted vs trainer-timed rank-step compute over the fit's "
        "window (--cost-model auto; trainers report with ODBClient.report_compute), for the "
        "fitted model and for the fixed one at its best scale; 1 = the planner uses the fit. "
        "Coefficients: odbd_cost_model_fitted_seconds{term}.",
    )


def rounds(b: Board) -> None:
    b.row("3. Alignment rounds and stragglers")
    buckets = f"rate(odbd_round_duration_seconds_bucket{J}{RI})"

    def quantile(q: float) -> str:
        return f"histogram_quantile({q}, sum by (le) ({buckets}))"

    b.series(
        "Round duration",
        [
            (quantile(0.5), "p50"),
            (quantile(0.99), "p99"),
        ],
        "s",
        "Barrier exchange time per round. Rising toward --round-timeout: a node is stalling.",
        thresholds((None, _GREEN), (1, _YELLOW), (10, _RED)),
        w=6,
    )
    b.series(
        "Last-arriving peer (share of rounds)",
        [
            (
                f"max by (peer) (rate(odbd_round_last_peer_total{J}{RI})) / ignoring(peer) "
                f"group_left max(rate(odbd_rounds_total{J}{RI}))",
                "node {{peer}}",
            )
        ],
        "percentunit",
        "The node whose offer completed the round. One node near 100 % is the straggler.",
        thresholds((None, _GREEN), (0.75, _YELLOW), (0.9, _RED)),
        w=6,
    )
    b.series(
        "Step cost imbalance (max / mean rank)",
        [
            (
                f"max(rate(odbd_step_max_work_total{J}{RI})) / "
                f"max(rate(odbd_step_mean_work_total{J}{RI}))",
                "imbalance",
            )
        ],
        "none",
        "Slowest rank's planned cost over the mean per step (1.0 = perfect; target <= 1.05).",
        thresholds((None, _GREEN), (1.05, _YELLOW), (1.2, _RED)),
        w=6,
    )
    b.series(
        "Round traffic per round, by daemon",
        [
            (
                f"sum by (instance, direction) (rate(odbd_round_payload_bytes_total{J}{RI})) / "
                "ignoring(direction) group_left "
                f"max by (instance) (rate(odbd_rounds_total{J}{RI}))",
                "{{instance}} {{direction}}",
            )
        ],
        "bytes",
        "Bytes of round messages each daemon sent and received per round. The hub's sent "
        "bytes are the job's fan-out: they should grow with the node count, not its square.",
        NEUTRAL,
        w=6,
    )
    b.series(
        "Planning time per round (slowest daemon)",
        [
            (
                "histogram_quantile(0.5, max by (le) "
                f"(rate(odbd_round_planning_seconds_bucket{J}{RI})))",
                "p50",
            ),
            (
                "histogram_quantile(0.99, max by (le) "
                f"(rate(odbd_round_planning_seconds_bucket{J}{RI})))",
                "p99",
            ),
        ],
        "s",
        "A daemon's CPU time planning a round after its exchange; it delays every rank's next "
        "steps. Rising with the node count: the planner is not split.",
        thresholds((None, _GREEN), (0.05, _YELLOW), (0.25, _RED)),
        w=6,
    )
    b.series(
        "Rounds, splits, recirculated samples / s",
        [
            (f"max(rate(odbd_rounds_total{J}{RI}))", "rounds"),
            (f"max(rate(odbd_alignment_splits_total{J}{RI}))", "splits"),
            (f"max(rate(odbd_recirculated_samples_total{J}{RI}))", "recirculated"),
        ],
        "short",
        "Alignment work: groups split and samples returned to the buffer for the next round.",
        NEUTRAL,
        w=6,
    )
    b.series(
        "Cross-node moves (--migrate auto)",
        [(f'sum(rate(odbd_migrated_bytes_total{{job=~"$job",direction="out"}}{RI}))', "moved")],
        "Bps",
        "Payload bytes of samples moved between nodes before rounds (planner/migration.py); "
        "0 with --migrate off. docs/bench/migration.md prices them on 25 and 100 Gb/s links.",
        w=12,
    )
    b.series(
        "Moves decisions / round",
        [
            (
                f"sum by (decision) (rate(odbd_migration_rounds_total{J}{RI})) / scalar("
                f"sum(rate(odbd_migration_rounds_total{J}{RI})))",
                "{{decision}}",
            )
        ],
        "percentunit",
        "Share of rounds whose moves the hub decided: none (nothing moved), balanced (cost "
        "levels evened across nodes) or dealt (the world's groups dealt, "
        "planner/migration_deal.py). Summed over daemons: every daemon counts every round.",
        w=12,
    )


def serving(b: Board) -> None:
    b.row("4. Serving and trainer overlap")
    b.series(
        "Pipeline overlap",
        [(OVERLAP_NOW, "job"), (OVERLAP_RANK, "rank {{rank}}")],
        "percentunit",
        "compute / (compute + wait in next()), as the trainers report it. Target >= 99 %.",
        HIGH_IS_GOOD,
        w=6,
    )
    b.series(
        "Trainer wait per step",
        [
            (
                f"{rate('odbd_trainer_wait_seconds_total', 'rank')} / "
                f"{rate('odbd_delivered_steps_total', 'rank')}",
                "rank {{rank}}",
            )
        ],
        "s",
        "Mean time a trainer blocked in next() per step.",
        NEUTRAL,
        w=6,
    )
    b.series(
        "Queued steps and attached trainers",
        [
            (f"odbd_queued_steps{J}", "queued {{instance}}"),
            (f"odbd_trainers{J}", "trainers {{instance}}"),
        ],
        "short",
        "Planned steps waiting for the local trainers; 0 with trainers attached = data-bound.",
        NEUTRAL,
        w=6,
    )
    b.series(
        "Steps delivered / s",
        [(rate("odbd_delivered_steps_total", "rank"), "rank {{rank}}")],
        "short",
        "Training steps per second as the trainers acknowledge them.",
        NEUTRAL,
        w=6,
    )
    b.series(
        "Trained samples / s",
        [
            (rate("odbd_delivered_samples_total"), "job"),
            (rate("odbd_delivered_samples_total", "rank"), "rank {{rank}}"),
        ],
        "short",
        "Samples in the steps the trainers took (delivered), not planned: the planner runs "
        "up to --steps-ahead steps ahead. `odbd status` shows the same over its last 30 s.",
        NEUTRAL,
    )
    b.series(
        "Trained loss tokens / s",
        [
            (rate("odbd_delivered_loss_tokens_total"), "job"),
            (rate("odbd_delivered_loss_tokens_total", "rank"), "rank {{rank}}"),
        ],
        "short",
        "Loss-bearing tokens in the steps the trainers took.",
        NEUTRAL,
    )
    b.series(
        "Epoch: planned vs trained",
        [
            (f"max(odbd_epoch{J})", "planned"),
            (f"min(odbd_trained_epoch{J})", "trained (slowest rank)"),
            (f"max(odbd_epochs_total{J})", "planned in full"),
            (f"min(odbd_trained_epochs_total{J})", "trained in full (slowest rank)"),
        ],
        "short",
        "The epoch the planner is in and the one the trainers are in; epochs planned to the "
        "end and trained to the end. A small epoch is planned in full at start-up.",
        NEUTRAL,
    )


def quota(b: Board) -> None:
    b.row("5. Quota and coverage")
    b.series(
        "Job quota",
        [(QUOTA, "planned"), (QUOTA_TRAINED, "trained"), (QUOTA_RANK, "planned, rank {{rank}}")],
        "percentunit",
        "Samples planned (emitted) and trained (in delivered steps) / (epochs x N); per rank "
        "against its 1/W share.",
        w=12,
    )
    b.series(
        "Epoch progress and identity coverage",
        [(EPOCH_PROGRESS, "samples emitted"), (EPOCH_COVERAGE, "identities covered")],
        "percentunit",
        "This epoch: samples emitted and distinct identities emitted, over N.",
        w=12,
    )


def dashboard() -> dict[str, Any]:
    b = Board()
    for section in (overview, ingest, planning, rounds, serving, quota):
        section(b)
    datasource = {"name": "datasource", "type": "datasource", "query": "prometheus"}
    job = {
        "name": "job",
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": "label_values(odbd_build_info, job)",
        "refresh": 2,
        "includeAll": True,
        "allValue": ".*",
        "multi": False,
        "current": {"text": "All", "value": "$__all"},
    }
    return {
        "uid": "odbd",
        "title": "odbd: online dynamic batching",
        "tags": ["odbd", "training"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [datasource, job]},
        "panels": b.panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if the JSON is out of date")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {__file__}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
