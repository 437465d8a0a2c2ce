"""Cross-node moves on the split planner (issue 26 item 1 a): plan_migration's decision made by
the hub from O(bins) digests, each node picking its concrete samples from its own buffer.

Why: the live daemons no longer see each other's samples (daemon/split_round.py), so the hub
cannot pool every node's offer as planner/migration.py does in `simulate`. What plan_migration
reads of a sample is its one-sample work (cost level), its length (groups of one, holds over
the budget), its age (HOLD_ROUNDS) and its bytes. A node's digest buckets its buffered samples
by work on a fixed log scale (FINE_STEP apart, the same edges on every node since every daemon
holds the same cost model) and sends per bucket: count, summed length, summed patches, summed
bytes and the oldest age. The hub expands each bucket into `count` equal stand-ins, runs the
unchanged plan_migration on them, and reduces its moves to counts: node u sends n of bucket b to
node v, and holds m of bucket b. A node sends its cheapest n of the bucket (plan_migration
sends a unit's cheapest of a level) and holds its costliest m (it holds a block's costliest),
ties broken by view key, so the choice is deterministic and needs nothing but its own buffer.

Three phases, all pure:
    node_digest(offer, config, sizes)           on every node  -> UnitDigest (O(buckets))
    hub_moves(digests, config, link)            on the hub     -> MoveDecision (O(moves))
    pick_moves(offer, moves of the unit, ...)   on every node  -> NodeMoves (concrete rows)
`plan_digested` chains them over whole-world offers and returns a MigrationPlan as
plan_migration does, so `simulate` can measure what the live decision costs against the pooled
one (docs/bench/migration.md).

The approximation: stand-ins of a bucket share one work (its mean length's), so a level's edge
and a block's spread are known to FINE_STEP (0.5 %, as wide as HOLD_SPREAD). The hub still
expands to one stand-in per buffered sample (its CPU is O(samples of the world) per round, as
the pooled decision's was on every daemon); the wire is O(buckets) per node and O(moves) back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from odbd.errors import InvariantError
from odbd.planner.config import PlannerConfig
from odbd.planner.migration import LinkModel, MigrationPlan, plan_migration
from odbd.planner.types import IntArray, SampleTable, UnitOffer

# Buckets of one-sample work FINE_STEP apart on a log scale, the hold spread's width (0.5 %).
# Measured against the pooled decision (docs/bench/migration.md): at 1 % longtail W=128 fell
# to 0.9896x the oracle (pooled 0.9913), at 0.5 % 0.9912. A buffer of lengths 1..3 L under
# the default model spans ~3,000 possible buckets, of which a node's buffer fills a few
# hundred (34 bytes each on the wire, daemon/migration_codec.py).
FINE_STEP = 0.005
_LOG_STEP = math.log1p(FINE_STEP)


@dataclass(frozen=True, slots=True)
class UnitDigest:
    """One unit's buffered samples bucketed by work: what the hub needs to decide moves."""

    unit: int
    dry: bool
    buckets: IntArray  # (b,) bucket ids, ascending
    counts: IntArray  # (b,) samples in each
    lengths: IntArray  # (b,) their summed lengths
    patches: IntArray  # (b,) their summed patches
    nbytes: IntArray  # (b,) their summed payload bytes
    ages: IntArray  # (b,) the oldest age among them

    @property
    def num_samples(self) -> int:
        return int(self.counts.sum())


@dataclass(frozen=True, slots=True)
class UnitMoves:
    """The hub's answer to one unit: how many of each bucket it sends where, and holds."""

    unit: int
    send_buckets: IntArray  # (m,) bucket of each send
    send_targets: IntArray  # (m,) unit it goes to
    send_counts: IntArray  # (m,) how many
    hold_buckets: IntArray  # (h,) bucket of each hold
    hold_counts: IntArray  # (h,) how many of it wait a round

    @staticmethod
    def none(unit: int) -> UnitMoves:
        z = np.zeros(0, dtype=np.int64)
        return UnitMoves(unit, z, z, z, z, z)

    @property
    def num_sent(self) -> int:
        return int(self.send_counts.sum())


@dataclass(frozen=True, slots=True)
class MoveDecision:
    """The hub's decision for the round: every unit's moves, and what the link model said."""

    moves: tuple[UnitMoves, ...]  # unit order
    bins: int
    gain_s: float
    move_s: float
    dealt: bool = False  # the samples that share groups were dealt (migration_deal.py)


@dataclass(frozen=True, slots=True)
class NodeMoves:
    """One unit's concrete moves: the rows of its offer it keeps, sends (to whom) and holds."""

    unit: int
    keep: IntArray  # rows of the offer that stay and are planned this round
    send_rows: IntArray  # rows sent, grouped by target (ascending), costliest first within
    send_targets: IntArray  # (len(send_rows),) the unit each goes to
    hold_rows: IntArray  # rows kept out of this round (back in the buffer one age older)


def work_of(samples: SampleTable, config: PlannerConfig) -> np.ndarray:
    """plan_migration's one-sample work: the cost model over one sample's length and patches."""
    n = samples.lengths.astype(np.float64)
    return np.asarray(config.cost.work(n, n**2, samples.patches), dtype=np.float64)


def bucket_of(work: np.ndarray) -> IntArray:
    """Bucket ids of works (>= 0): floor(log(work) / log(1 + FINE_STEP)); work <= 0 -> bucket
    of the smallest positive float, so ids are total-ordered like the works."""
    w = np.maximum(np.asarray(work, dtype=np.float64), np.finfo(np.float64).tiny)
    return np.floor(np.log(w) / _LOG_STEP).astype(np.int64)


def node_digest(
    offer: UnitOffer,
    config: PlannerConfig,
    sizes: IntArray | None = None,
    link: LinkModel | None = None,
) -> UnitDigest:
    """A unit's digest of its offer. `sizes[i]` is row i's payload bytes (default length x
    link.bytes_per_token, plan_migration's default)."""
    t = offer.samples
    nbytes = _sizes(t, sizes, link or LinkModel())
    bucket = bucket_of(work_of(t, config))
    ids, inverse = np.unique(bucket, return_inverse=True)
    k = int(ids.shape[0])

    def summed(x: IntArray) -> IntArray:
        return np.bincount(inverse, weights=x, minlength=k).astype(np.int64)

    oldest = np.zeros(k, dtype=np.int64)
    np.maximum.at(oldest, inverse, t.ages)
    return UnitDigest(
        offer.unit,
        offer.dry,
        ids.astype(np.int64),
        np.bincount(inverse, minlength=k).astype(np.int64),
        summed(t.lengths),
        summed(t.patches),
        summed(nbytes),
        oldest,
    )


def hub_moves(
    digests: Sequence[UnitDigest], config: PlannerConfig, link: LinkModel
) -> MoveDecision:
    """The round's moves from every unit's digest (unit order): plan_migration over stand-ins,
    reduced to counts per (source, bucket, target) and holds per (unit, bucket)."""
    offers, sizes, works, ties, bucket_of_view, unit_of_view = _stand_ins(digests)
    plan = plan_migration(offers, config, link, sizes, works=works, ties=ties)
    moves = []
    for d in digests:
        sent = plan.sources == d.unit
        buckets, targets, counts = _count_pairs(
            bucket_of_view[plan.views[sent]], plan.targets[sent]
        )
        held = plan.held[d.unit].views if plan.held else np.zeros(0, np.int64)
        hb, hc = np.unique(bucket_of_view[held], return_counts=True)
        if held.size and (unit_of_view[held] != d.unit).any():
            raise InvariantError(f"unit {d.unit} holds another unit's stand-ins")
        moves.append(
            UnitMoves(d.unit, buckets, targets, counts, hb.astype(np.int64), hc.astype(np.int64))
        )
    return MoveDecision(tuple(moves), plan.bins, plan.gain_s, plan.move_s, plan.dealt)


def pick_moves(offer: UnitOffer, moves: UnitMoves, config: PlannerConfig) -> NodeMoves:
    """The concrete rows of `offer` behind the hub's counts: in each bucket, sorted costliest
    first (ties: view key), the costliest `hold` wait and the cheapest `sent` go, to the targets
    in ascending unit order; the rest stay. Refuses counts the buffer cannot meet."""
    t = offer.samples
    work = work_of(t, config)
    bucket = bucket_of(work)
    order = np.lexsort((t.views, -work))  # costliest first, then view key
    by_bucket: dict[int, list[int]] = {}
    for row in order.tolist():
        by_bucket.setdefault(int(bucket[row]), []).append(row)
    keep = np.ones(len(t), dtype=bool)
    hold_rows: list[int] = []
    for b, n in zip(moves.hold_buckets.tolist(), moves.hold_counts.tolist(), strict=True):
        rows = by_bucket.get(b, [])
        if n > len(rows):
            raise InvariantError(
                f"unit {offer.unit}: told to hold {n} of bucket {b}, holds {len(rows)}"
            )
        hold_rows += rows[:n]
        by_bucket[b] = rows[n:]
    send_rows: list[int] = []
    send_targets: list[int] = []
    per_bucket: dict[int, list[tuple[int, int]]] = {}
    for b, v, n in zip(
        moves.send_buckets.tolist(),
        moves.send_targets.tolist(),
        moves.send_counts.tolist(),
        strict=True,
    ):
        per_bucket.setdefault(b, []).append((v, n))
    pairs: list[tuple[int, int]] = []  # (target, row)
    for b, wants in sorted(per_bucket.items()):
        rows = by_bucket.get(b, [])
        total = sum(n for _, n in wants)
        if total > len(rows):
            raise InvariantError(
                f"unit {offer.unit}: told to send {total} of bucket {b}, holds {len(rows)}"
            )
        cheapest = rows[len(rows) - total :]
        start = 0
        for v, n in sorted(wants):
            pairs += [(v, r) for r in cheapest[start : start + n]]
            start += n
    rank = np.empty(len(t), dtype=np.int64)
    rank[order] = np.arange(len(t))
    pairs.sort(key=lambda p: (p[0], rank[p[1]]))
    send_targets = [v for v, _ in pairs]
    send_rows = [r for _, r in pairs]
    keep[np.asarray(hold_rows + send_rows, dtype=np.int64)] = False
    return NodeMoves(
        offer.unit,
        np.flatnonzero(keep).astype(np.int64),
        np.asarray(send_rows, dtype=np.int64),
        np.asarray(send_targets, dtype=np.int64),
        np.sort(np.asarray(hold_rows, dtype=np.int64)),
    )


def plan_digested(
    offers: Sequence[UnitOffer],
    config: PlannerConfig,
    link: LinkModel,
    sample_bytes: Sequence[IntArray] | None = None,
) -> MigrationPlan:
    """The live decision over whole-world offers (simulate, tests): every unit's digest, the
    hub's moves, every unit's pick, assembled into plan_migration's MigrationPlan."""
    given = list(sample_bytes) if sample_bytes is not None else [None] * len(offers)
    sizes = [_sizes(o.samples, s, link) for o, s in zip(offers, given, strict=True)]
    offered = int(sum(int(s.sum()) for s in sizes))
    digests = [node_digest(o, config, s, link) for o, s in zip(offers, sizes, strict=True)]
    decision = hub_moves(digests, config, link)
    picks = [pick_moves(o, m, config) for o, m in zip(offers, decision.moves, strict=True)]
    arriving: list[list[SampleTable]] = [[] for _ in offers]
    views, sources, targets, nbytes = [], [], [], []
    for o, p, s in zip(offers, picks, sizes, strict=True):
        for v in np.unique(p.send_targets).tolist():
            rows = p.send_rows[p.send_targets == v]
            arriving[v].append(o.samples.take(rows))
        views.append(o.samples.views[p.send_rows])
        sources.append(np.full(p.send_rows.shape[0], o.unit, np.int64))
        targets.append(p.send_targets)
        nbytes.append(s[p.send_rows])
    new_offers = tuple(
        UnitOffer(
            o.unit, SampleTable.concat_all([o.samples.take(p.keep), *arriving[o.unit]]), o.dry
        )
        for o, p in zip(offers, picks, strict=True)
    )
    held = tuple(o.samples.take(p.hold_rows).aged() for o, p in zip(offers, picks, strict=True))
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    return MigrationPlan(
        new_offers,
        cat(views).astype(np.int64),
        cat(sources),
        cat(targets).astype(np.int64),
        cat(nbytes).astype(np.int64),
        decision.bins,
        decision.gain_s,
        decision.move_s,
        offered,
        held if any(len(h) for h in held) else (),
        decision.dealt,
    )


def _sizes(t: SampleTable, sizes: IntArray | None, link: LinkModel) -> IntArray:
    if sizes is None:
        return np.ceil(t.lengths * link.bytes_per_token).astype(np.int64)
    out = np.asarray(sizes, dtype=np.int64)
    if out.shape != t.views.shape:
        raise InvariantError(f"{out.shape[0]} sizes for {len(t)} samples")
    return out


def _stand_ins(
    digests: Sequence[UnitDigest],
) -> tuple[list[UnitOffer], list[IntArray], list[np.ndarray], list[IntArray], IntArray, IntArray]:
    """Every digest's buckets as `count` equal samples (mean length and patches, the bytes split
    as evenly as integers allow, every one of the bucket's oldest age). Stand-ins of a bucket
    share its work (its geometric middle, the same on every unit) and interleave across units
    by their index in it, as equal real samples interleave by row: ordered by the units' own
    means, one unit's whole bucket would come first, and a level cut inside it would be all
    one unit's (measured: 3.4x the bytes moved on trimodal at W=16). Stand-in view keys are
    positions in one world-wide numbering; returns the offers, their bytes, works and ties,
    and per view key its bucket and unit."""
    offers, sizes, works, ties, buckets, units = [], [], [], [], [], []
    start = 0
    for d in digests:
        n = d.counts
        total = int(n.sum())
        lengths = np.repeat(_spread(d.lengths, n), 1) if total else np.zeros(0, np.int64)
        table = SampleTable.of(
            np.arange(start, start + total),
            lengths,
            ages=np.repeat(d.ages, n),
            patches=_spread(d.patches, n),
        )
        start += total
        offers.append(UnitOffer(d.unit, table, d.dry))
        sizes.append(_spread(d.nbytes, n))
        works.append(np.repeat(np.exp((d.buckets + 0.5) * _LOG_STEP), n))
        ties.append(np.arange(total) - np.repeat(np.cumsum(n) - n, n))
        buckets.append(np.repeat(d.buckets, n))
        units.append(np.full(total, d.unit, np.int64))
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    return offers, sizes, works, ties, cat(buckets), cat(units)


def _spread(sums: IntArray, counts: IntArray) -> IntArray:
    """Per bucket, `count` integers summing to its sum, as equal as can be (larger first)."""
    if not counts.size:
        return np.zeros(0, np.int64)
    base, extra = np.divmod(sums, np.maximum(counts, 1))
    out = np.repeat(base, counts)
    pos = np.repeat(np.arange(counts.shape[0]), counts)
    first = np.cumsum(counts) - counts
    offset = np.arange(out.shape[0]) - first[pos]
    return (out + (offset < extra[pos])).astype(np.int64)


def _count_pairs(buckets: IntArray, targets: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    if not buckets.size:
        z = np.zeros(0, np.int64)
        return z, z, z
    pairs = np.stack([buckets, targets], axis=1)
    uniq, counts = np.unique(pairs, axis=0, return_counts=True)
    return uniq[:, 0].astype(np.int64), uniq[:, 1].astype(np.int64), counts.astype(np.int64)
