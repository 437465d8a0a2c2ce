"""`odbd simulate --migrate auto`: what the cross-node moves (planner/migration.py) cost.

Bytes moved per round against bytes ingested, and the busiest node's moves on a 100 Gb/s and a
25 Gb/s link against the round's simulated time (the cost model's work in seconds at the link
model's seconds per token-equivalent): a move overlaps the trainers' current steps, so it is
hidden while it takes less than a round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from odbd.planner.config import CostModel
from odbd.planner.epoch import SimulationResult
from odbd.planner.migration import LinkModel

LINKS_GBPS = (100.0, 25.0)  # the links the issue asks about


@dataclass(frozen=True, slots=True)
class LinkCost:
    gbps: float
    mean_s: float  # the busiest node's moves per round, mean over rounds
    max_s: float
    max_share: float  # the most any round's moves take of that round's time (1 = all of it)


@dataclass(frozen=True, slots=True)
class MigrationReport:
    rounds: int
    rounds_with_moves: int
    samples_moved: int
    samples_planned: int
    bytes_moved: int
    bytes_ingested: int
    mean_round_bytes: float
    max_round_bytes: int
    links: tuple[LinkCost, ...]

    @property
    def byte_share(self) -> float:
        return self.bytes_moved / self.bytes_ingested if self.bytes_ingested else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "rounds_with_moves": self.rounds_with_moves,
            "samples_moved": self.samples_moved,
            "bytes_moved": self.bytes_moved,
            "bytes_ingested": self.bytes_ingested,
            "bytes_moved_share": self.byte_share,
            "mean_round_bytes": self.mean_round_bytes,
            "max_round_bytes": self.max_round_bytes,
            "links": {
                f"{c.gbps:g}gbps": {
                    "mean_s": c.mean_s,
                    "max_s": c.max_s,
                    "max_share_of_round": c.max_share,
                }
                for c in self.links
            },
        }


def summarize_migration(
    result: SimulationResult, cost: CostModel, link: LinkModel
) -> MigrationReport:
    rounds = len(result.rounds)
    round_s = np.array(
        [
            (cost.c * k + float(r.stats.work[:k].max(axis=1).sum())) * link.seconds_per_work
            for r, k in zip(result.rounds, result.steps_kept, strict=True)
        ]
    )
    peak = result.moved_peak_bytes.astype(np.float64)
    links = []
    for gbps in LINKS_GBPS:
        seconds = peak / (gbps * 1e9 / 8)
        share = np.divide(seconds, round_s, out=np.zeros_like(seconds), where=round_s > 0)
        links.append(
            LinkCost(
                gbps,
                float(seconds.mean()) if rounds else 0.0,
                float(seconds.max(initial=0.0)),
                float(share.max(initial=0.0)),
            )
        )
    moved = result.moved_bytes
    return MigrationReport(
        rounds=rounds,
        rounds_with_moves=int(np.count_nonzero(result.moved_samples)),
        samples_moved=int(result.moved_samples.sum()),
        samples_planned=int(result.stats().num_samples.sum()),
        bytes_moved=int(moved.sum()),
        bytes_ingested=int(result.ingested_bytes.sum()),
        mean_round_bytes=float(moved.mean()) if rounds else 0.0,
        max_round_bytes=int(moved.max(initial=0)),
        links=tuple(links),
    )


def render_migration(report: MigrationReport) -> str:
    lines = [
        f"migration: {report.samples_moved:,} samples moved between nodes in "
        f"{report.rounds_with_moves} of {report.rounds} rounds; {_mib(report.bytes_moved)} of "
        f"{_mib(report.bytes_ingested)} ingested ({100 * report.byte_share:.2f} %), per round "
        f"mean {_mib(report.mean_round_bytes)}, max {_mib(report.max_round_bytes)}"
    ]
    for c in report.links:
        lines.append(
            f"  at {c.gbps:g} Gb/s the busiest node's moves take {1e3 * c.mean_s:.2f} ms per "
            f"round (max {1e3 * c.max_s:.2f} ms, at most {100 * c.max_share:.3g} % of its "
            "round; they overlap the trainers' steps)"
        )
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"
