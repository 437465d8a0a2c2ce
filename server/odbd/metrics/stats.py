"""The daemon's statistics: plain numbers, cheap to update from the event loop.

Nothing here touches prometheus_client; collector.py renders these at scrape time, so the hot
path pays an integer add, never a lock or a label lookup.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from odbd.daemon.trained import NodeTrained, RankTrained
from odbd.planner.config import CostModel
from odbd.round.traffic import RoundTraffic

if TYPE_CHECKING:
    from odbd.config import DaemonConfig
    from odbd.planner.cost_fit import CostFit

# Round latencies on loopback are ~1 ms; a slow peer can take seconds.
# Optimizer updates (--accumulate / --tokens-per-update): loss tokens and micro-steps per update.
UPDATE_TOKEN_BUCKETS = tuple(float(2**k) for k in range(8, 25))
UPDATE_STEP_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0, 128.0)
# Planning one round: ~1 ms for a few ranks, tens of ms at W = 128 on one daemon's share.
PLANNING_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                      0.25, 0.5, 1, 2.5)  # fmt: skip
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


# What the hub's moves decision of a round can be (--migrate auto): nothing moved, cost levels
# balanced, or the world's groups dealt; /metrics exports each, 0 until it happens
MIGRATION_DECISIONS = ("none", "balanced", "dealt")


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; +Inf last
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


@dataclass(slots=True)
class RankStats:
    """One local rank's totals (counters)."""

    steps: int = 0
    idle_steps: int = 0
    samples: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    loss_tokens: int = 0
    wait_s: float = 0.0  # trainer blocked in next()
    compute_s: float = 0.0  # trainer busy between next() calls
    delivered_steps: int = 0


@dataclass(slots=True)
class DaemonStats:
    node_rank: int
    dataset_size: int
    world_size: int = 0
    num_nodes: int = 1
    epochs: int = 0  # epochs of the job; 0 = endless (no job quota)
    ranks: dict[int, RankStats] = field(default_factory=dict)
    # Global facts every daemon computes from the same plans (so any daemon can be scraped).
    global_steps: int = 0
    global_samples: int = 0
    global_tokens: int = 0
    step_max_work: float = 0.0  # sum over steps of max_r work
    step_mean_work: float = 0.0  # sum over steps of mean_r work
    cost_fit: CostFit | None = None  # the cost model fit of the last round (cost_fit.py)
    cost_learned: bool = False  # the planner used the fitted model in the last round
    fixed_cost: CostModel = field(default_factory=CostModel)  # what it uses otherwise
    epoch: int = 0  # being planned (ahead of training by the queued steps)
    # The epoch planned last: its steps so far and after, as the planner estimates them, exact
    # once it planned the epoch's last step (planner/progress.py), and its steps planned so far.
    planned_epoch: int = 0  # epoch of the step planned last
    planned_epoch_steps: int = 0
    planned_epoch_steps_exact: bool = False
    planned_epoch_steps_so_far: int = 0
    exact_epoch_steps: dict[int, int] = field(default_factory=dict)  # epoch -> steps, recent
    # What the local ranks' trainers took (daemon/trained.py): the queues' own RankTrained.
    trained: NodeTrained = field(default_factory=NodeTrained)
    epoch_samples: int = 0  # emitted this epoch, every rank
    epoch_identities: int = 0
    epochs_done: int = 0
    rounds: int = 0
    round_duration: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS_S))
    last_peer: Counter[int] = field(default_factory=Counter)  # node whose offer came last
    # This daemon's own round work: the planning of each round (its CPU on the critical path,
    # after the exchange) and the round messages over its peer streams (the barrier's object).
    round_planning: Histogram = field(default_factory=lambda: Histogram(PLANNING_BUCKETS_S))
    round_traffic: RoundTraffic = field(default_factory=RoundTraffic)
    splits: int = 0
    recirculated: int = 0
    # Optimizer updates, every rank (global, from the plans); empty without windows.
    updates: int = 0
    epoch_updates: int = 0  # updates of the epoch planned last (so far, or in all once it ended)
    update_tokens: Histogram = field(default_factory=lambda: Histogram(UPDATE_TOKEN_BUCKETS))
    update_steps: Histogram = field(default_factory=lambda: Histogram(UPDATE_STEP_BUCKETS))
    # This node's ingest.
    ingest_samples: int = 0
    ingest_bytes: int = 0
    expired_leases: int = 0
    lanes_full_rounds: int = 0  # rounds offered before a full buffer: every lane was full
    rejected: Counter[str] = field(default_factory=Counter)
    # this node's samples emitted with more tokens than the budget (or patches than --max-patches)
    oversized_samples: int = 0
    # --migrate auto (daemon/migration_live.py): samples and payload bytes this node moved to
    # other nodes (out) and received from them (in), and the seconds its sends took
    migrated_out_samples: int = 0
    migrated_out_bytes: int = 0
    migrated_in_samples: int = 0
    migrated_in_bytes: int = 0
    migrate_seconds: float = 0.0
    # rounds by the hub's decision, one of MIGRATION_DECISIONS (migration_codec.decision_of_moves)
    migration_rounds: Counter[str] = field(default_factory=Counter)
    producers_restarted: int = 0
    serving: bool = False  # what grpc.health.v1 reports for this daemon
    # The metrics' own cost: CPU the metrics thread spent rendering scrapes (thread time).
    scrapes: int = 0
    scrape_cpu_s: float = 0.0

    def record_updates(self, steps: list[int], tokens: list[int]) -> None:
        """One round's updates: micro-steps and loss tokens of each."""
        self.updates += len(steps)
        for n, t in zip(steps, tokens, strict=True):
            self.update_steps.observe(n)
            self.update_tokens.observe(t)

    def record_planned(
        self, epochs: list[int], numbers: list[int], estimates: list[int], exact: list[bool]
    ) -> None:
        """A round's kept steps (epoch, number, epoch length estimate, exact): where planning
        stands, and the exact lengths `odbd status` shows next to the trainers' position."""
        if not epochs:
            return
        self.planned_epoch, self.planned_epoch_steps_so_far = epochs[-1], numbers[-1] + 1
        self.planned_epoch_steps, self.planned_epoch_steps_exact = estimates[-1], exact[-1]
        for epoch, steps, known in zip(epochs, estimates, exact, strict=True):
            if known:
                self.exact_epoch_steps[epoch] = steps
        for epoch in sorted(self.exact_epoch_steps)[:-8]:  # the trainers' recent epochs only
            del self.exact_epoch_steps[epoch]

    @classmethod
    def for_config(cls, config: DaemonConfig, dataset_size: int) -> DaemonStats:
        """Stats with every local rank present from the start.

        A rank's series then begin at 0 in Prometheus, so rate() and increase() over a window
        that starts before the job count the whole job (a series that appears mid-job at a
        non-zero value loses its first increment).
        """
        stats = cls(
            node_rank=config.node_rank,
            dataset_size=dataset_size,
            world_size=config.world.world_size,
            num_nodes=config.world.num_nodes,
            epochs=config.epochs,
        )
        for rank in config.local_ranks:
            stats.rank(rank)
            stats.trained.ranks[rank] = RankTrained()  # the daemon puts its queues' in place
        return stats

    def rank(self, rank: int) -> RankStats:
        if rank not in self.ranks:
            self.ranks[rank] = RankStats()
        return self.ranks[rank]


def by_reason(counts: Counter[str]) -> dict[str, int]:
    return dict(defaultdict(int, counts))
