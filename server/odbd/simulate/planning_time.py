"""`odbd simulate --planning-time`: what one daemon spends planning a round, and the bytes of a
round's payloads, from the RoundTrace of a simulated run (planner/round.py).

The simulation plans every node in one process; each node's own phases are timed apart, so a
daemon's time per round is its node's phases plus the shared decisions (summary.py lists the
phases). "whole world" is every node's phases plus the decisions: what each daemon spent when it
planned every rank. Payload bytes are those of the encoded payloads every daemon receives per
round: the split round's summaries and step totals (daemon/summary_codec.py), and, for
comparison, the offers of every buffered sample the daemons exchange today
(daemon/offer_codec.py, whose size depends only on the units' sample counts), and the time one
daemon takes to decode every node's payloads of a round (the exchange's share of the CPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from odbd.daemon import offer_codec, summary_codec
from odbd.planner.config import PlannerConfig
from odbd.planner.round import RoundTrace, units_of_node
from odbd.planner.types import SampleTable, UnitOffer, UnitSummary


@dataclass(frozen=True, slots=True)
class PlanningReport:
    num_rounds: int
    num_nodes: int
    daemon_ms_median: float  # over every (round, daemon)
    daemon_ms_p90: float
    slowest_daemon_ms_median: float  # per round the slowest daemon, median over rounds
    whole_world_ms_median: float  # per round, one process planning every node
    summary_bytes: float  # per round, every node's summary payload (median over rounds)
    totals_bytes: float  # per round, every node's step-totals payload
    offer_bytes: float  # per round, every node's full offer payload (the exchange today)
    decode_ms: float  # per round, one daemon decoding every node's summary and totals payload
    offer_decode_ms: float  # per round, one daemon decoding every node's offer payload

    def as_json(self) -> dict[str, float | int]:
        return asdict(self)


def planning_report(trace: RoundTrace, config: PlannerConfig) -> PlanningReport:
    daemon_ms = 1e3 * trace.per_daemon_s()
    nodes = range(config.world.num_nodes)
    summary, totals, offers, decode_s, offer_decode_s = [], [], [], [], []
    for units, node_totals in zip(trace.summaries, trace.totals, strict=True):
        split = [_summary_payload(units, config, n) for n in nodes]
        split_totals = [summary_codec.encode_totals(t) for t in node_totals]
        full = [_offer_payload(units, config, n) for n in nodes]
        summary.append(sum(len(p) for p in split))
        totals.append(sum(len(p) for p in split_totals))
        offers.append(sum(len(p) for p in full))
        decode_s.append(_decode_s(split, summary_codec.decode_summary))
        decode_s[-1] += _decode_s(split_totals, summary_codec.decode_totals)
        offer_decode_s.append(_decode_s(full, offer_codec.decode))
    return PlanningReport(
        num_rounds=len(trace.shared_s),
        num_nodes=config.world.num_nodes,
        daemon_ms_median=float(np.median(daemon_ms)),
        daemon_ms_p90=float(np.percentile(daemon_ms, 90)),
        slowest_daemon_ms_median=float(np.median(daemon_ms.max(axis=1))),
        whole_world_ms_median=float(np.median(1e3 * trace.whole_world_s())),
        summary_bytes=float(np.median(summary)),
        totals_bytes=float(np.median(totals)),
        offer_bytes=float(np.median(offers)),
        decode_ms=1e3 * float(np.median(decode_s)),
        offer_decode_ms=1e3 * float(np.median(offer_decode_s)),
    )


def render_planning(report: PlanningReport) -> str:
    r = report
    split_kib = (r.summary_bytes + r.totals_bytes) / 1024
    return "\n".join(
        [
            f"planning time per round ({r.num_rounds} rounds, {r.num_nodes} daemons simulated):",
            f"  per daemon (own node + shared decisions): median {r.daemon_ms_median:.2f} ms, "
            f"p90 {r.daemon_ms_p90:.2f} ms; slowest daemon median "
            f"{r.slowest_daemon_ms_median:.2f} ms",
            f"  whole world in one daemon (before the split): median "
            f"{r.whole_world_ms_median:.2f} ms "
            f"({r.whole_world_ms_median / max(r.daemon_ms_median, 1e-9):.1f}x)",
            f"  payload per round, all nodes: summaries {r.summary_bytes / 1024:.1f} KiB + step "
            f"totals {r.totals_bytes / 1024:.1f} KiB = {split_kib:.1f} KiB; full offers "
            f"{r.offer_bytes / 1024:.1f} KiB",
            f"  decoding them, per daemon: {r.decode_ms:.2f} ms; the full offers "
            f"{r.offer_decode_ms:.2f} ms",
        ]
    )


def _decode_s(payloads: list[bytes], decode: Callable[[bytes], object]) -> float:
    start = time.perf_counter()
    for payload in payloads:
        decode(payload)
    return time.perf_counter() - start


def _summary_payload(units: list[UnitSummary], config: PlannerConfig, node: int) -> bytes:
    mine = tuple(units[u] for u in units_of_node(config, node))
    return summary_codec.encode_summary(summary_codec.NodeSummary(node, 0, mine))


def _offer_payload(units: list[UnitSummary], config: PlannerConfig, node: int) -> bytes:
    """The node's offer payload: fixed-width columns, so sample values do not change its size."""
    offers = tuple(
        UnitOffer(u, _zeros(units[u].num_samples), units[u].dry)
        for u in units_of_node(config, node)
    )
    return offer_codec.encode(offer_codec.NodeOffer(node, 0, offers, {}))


def _zeros(n: int) -> SampleTable:
    z = np.zeros(n, dtype=np.int64)
    return SampleTable(z, z, z, z, z)
