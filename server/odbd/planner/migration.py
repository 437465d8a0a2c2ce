"""Cross-node post-balancing (`--migrate auto`): before a round is planned, move samples from
nodes that hold more than their share of a cost level to nodes that hold less.

Why: a plan that keeps every sample on the node whose producers made it pays for each node's
draw of the sampler. The busiest node sets every round's length (it holds 1-3 % more work than
the mean node on heavy tails), and a node's few samples over the budget (one group each) form
runs of 8 whose costs differ from the other nodes' runs, so each step lasts its costliest node's
run. Both are noise of the draw; moving a few samples per cost level removes it (the global
oracle of simulate/oracle.py is the reference; OrchMLLM's Batch Post-Balancing Dispatcher is
the same idea across DP ranks).

What moves: the round's samples, pooled over every node, sorted costliest first (cost model
work of one sample, a x l + b x l^2 + p x patches). Samples over L/2 (groups of one: no other
sample fits beside them) are cut into blocks of W, G per node, so each node's k-th run of G is
its share of the k-th block and step k runs W neighbours of the round's order; the rest is cut
into LEVELS bins of equal work, each node's target being its even share of a bin's count (the
remainder stays with the nodes holding the most). A node over its target sends its cheapest
samples of the level to the nodes under it. Levels are balanced costliest first, and
`plan_migration` takes the number whose estimated round-time gain beats the time the bytes
take on the link by the most (nothing moves when none does). In a round with a sample over
the budget, groups of one whose block of W spreads wider than HOLD_SPREAD wait for a later
round (_holds), where more of them meet, and so does their last partial block when a whole
block ran beside it: the steps that run them are the ones a round plan loses most to
(docs/bench/migration.md). In a padded min-time round the samples that share groups may
instead be dealt (migration_deal.py: the world's groups, group j to node j mod N), when the
work that saves, priced by cutting every node's samples, beats its extra link time.
Every daemon computes the same moves from the same inputs: this module is pure.

The link model: `bytes_per_s` per node and direction (a node sends and receives at once); the
round's move time is the busiest node's max(bytes out, bytes in) / bytes_per_s. It is charged
in full against the gain even though the move overlaps the trainers' current steps, so a move
is made only when it pays even without the overlap.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from odbd.errors import ConfigError, InvariantError
from odbd.planner.config import Balance, Collate, Grouping, PlannerConfig
from odbd.planner.migration_deal import cut_work, deal, fewest_moves
from odbd.planner.types import IntArray, SampleTable, UnitOffer


class Migrate(StrEnum):
    AUTO = "auto"  # move samples between nodes when the link model says it pays
    OFF = "off"  # every sample stays on the node whose producers made it


# 8 Gb/s: what one gRPC stream of 1 MiB messages carried over loopback on this machine (median
# 9.0 Gb/s, 2 cores at load ~14; memcpy 2.9 GiB/s there; docs/bench/migration.md). The bulk
# channel is such a stream, so this is the most a daemon moves whatever its NIC; on a slower
# link pass --link-gbps. A default above the real rate would move bytes that then delay the
# round, one below it only forgoes some gain (rounds last seconds, moves milliseconds).
DEFAULT_LINK_BYTES_PER_S = 8e9 / 8
# Seconds per token-equivalent of the default cost model (c = 1800 reproduces the paper's 8B
# step times): 6 x 8e9 FLOP per trained token at ~400 TFLOP/s (a ~1 PFLOP/s bf16 GPU at 40 %
# MFU) is 1.2e-4 s. Live daemons use their fitted cost model's seconds instead.
DEFAULT_SECONDS_PER_WORK = 1.2e-4
# Bytes a token takes in a sample when the real payload size is unknown (simulate): int32 ids.
DEFAULT_BYTES_PER_TOKEN = 4.0
LEVELS = 64  # equal-work bins of the pooled round's samples that can share a group
# Groups of one (samples over L/2) run W to a step; a step lasts its costliest. In a round with a
# sample over the budget, a block of W neighbours in cost order whose cheapest is under
# (1 - HOLD_SPREAD) x its costliest waits for the next round (its costliest member does), where
# more of them meet, and so does the last partial block when a whole block ran beside it: at
# most HOLD_ROUNDS rounds per sample, never in a round where every unit is dry (the epoch must
# flush). 0.5 % is the digest's bucket width (migration_digest.FINE_STEP); with the partial
# block waiting, heavy tail at W = 128 was 0.9904 / 0.9913 / 0.9911 of the global oracle at
# 1 % / 0.5 % / 0.25 % (2 %: 0.9901), over-budget 0.9938 / 0.9940 / 0.9945 (2 %: 0.9925).
HOLD_SPREAD = 0.005
HOLD_ROUNDS = 32
WORK_CANDIDATES = (2, 4, 8, 16, 32)  # bins balanced (costliest first) besides every bin
# The flush (every unit dry): after the levels, nodes over the mean total work send their
# cheapest samples that share groups (this share of them) to nodes under it (_equalize)
EQUALIZE_SHARE = 0.25


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkModel:
    """What moving a sample costs and what a token-equivalent of work is worth, in seconds."""

    bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S
    seconds_per_work: float = DEFAULT_SECONDS_PER_WORK
    bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ConfigError(
                f"--link-gbps must be > 0, got {self.bytes_per_s * 8 / 1e9:g}; pass the "
                "node's network bandwidth in Gb/s (or --migrate off to keep data local)"
            )
        if not (self.seconds_per_work > 0 and self.bytes_per_token > 0):
            raise ConfigError(f"seconds per work unit and bytes per token must be > 0, got {self}")


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    """One round's moves and the offers after them (identical on every daemon)."""

    offers: tuple[UnitOffer, ...]  # what plan_round plans: moved samples on their new unit
    views: IntArray  # (m,) view keys moved, costliest first
    sources: IntArray  # (m,) unit each came from
    targets: IntArray  # (m,) unit it goes to
    nbytes: IntArray  # (m,) bytes of each
    bins: int  # cost levels balanced (0: nothing moved)
    gain_s: float  # estimated round-time gain of the moves, seconds
    move_s: float  # the moves' time on the link (busiest node), seconds
    bytes_offered: int = 0  # bytes of every sample offered this round
    # per unit: samples over the budget kept out of this round's offer (back in its buffer for
    # the next round, one recirculation older); empty tables when nothing waits
    held: tuple[SampleTable, ...] = ()
    dealt: bool = False  # the samples that share groups were dealt (migration_deal.py)

    @property
    def num_moved(self) -> int:
        return int(self.views.shape[0])

    @property
    def bytes_moved(self) -> int:
        return int(self.nbytes.sum())

    def busiest_node_bytes(self, num_units: int) -> int:
        """The most bytes one node sends or receives: what sets the moves' time on the link."""
        if self.num_moved == 0:
            return 0
        out = np.bincount(self.sources, weights=self.nbytes, minlength=num_units)
        into = np.bincount(self.targets, weights=self.nbytes, minlength=num_units)
        return int(np.maximum(out, into).max())


def plan_migration(
    offers: Sequence[UnitOffer],
    config: PlannerConfig,
    link: LinkModel,
    sample_bytes: Sequence[IntArray] | None = None,
    *,
    works: Sequence[np.ndarray] | None = None,
    ties: Sequence[IntArray] | None = None,
) -> MigrationPlan:
    """The round's moves: balance the costliest k cost levels across nodes, k chosen by the
    estimated gain minus the link time, or deal the samples that share groups where that
    nets more (see the module docstring). `sample_bytes[u][i]` is the
    payload size of offers[u].samples row i (default: length x link.bytes_per_token).

    `works` and `ties` (per unit, per row) replace the cost model's one-sample work and the row
    as the order's key and its tie-break: migration_digest.py's stand-ins of a bucket share its
    work and interleave by their index in it, as real samples of equal cost interleave by row."""
    sizes = _sample_bytes(offers, link, sample_bytes)
    offered = int(sum(int(s.sum()) for s in sizes))
    nothing = _unchanged(offers, offered)
    if config.balance is not Balance.NODE or config.num_units < 2:
        return nothing
    pool = _Pool.of(offers, sizes, config, works, ties)
    if pool.n == 0:
        return nothing
    flush = all(o.dry for o in offers)
    before = _estimate(pool.unit, pool, config)
    best_k, best_net, best = 0, 0.0, (pool.unit, 0.0, 0.0)
    unit, done = pool.unit.copy(), 0
    for k in _candidates(pool):
        _balance_levels(pool, unit, range(done, k), config.num_units)
        done = k
        gain = (before - _estimate(unit, pool, config)) * link.seconds_per_work
        move_s = _move_seconds(pool, unit, config.num_units, link)
        if gain - move_s > best_net:
            best_k, best_net, best = k, gain - move_s, (unit.copy(), gain, move_s)
    if flush:
        even = best[0].copy()
        _equalize(pool, even, config.num_units)
        gain = (before - _estimate(even, pool, config)) * link.seconds_per_work
        move_s = _move_seconds(pool, even, config.num_units, link)
        if gain - move_s > best_net:
            best_k, best = max(best_k, 1), (even, gain, move_s)
    dealt = False
    if _may_deal(config):
        deal_unit = _dealt(pool, best[0], config, flush)
        saved = _estimate(best[0], pool, config, cut=True) - _estimate(
            deal_unit, pool, config, cut=True
        )
        extra = saved * link.seconds_per_work
        move_s = _move_seconds(pool, deal_unit, config.num_units, link)
        dealt = extra > move_s - best[2]  # beats the best balance's net gain (>= 0)
        if dealt:
            best_k, best = len(pool.levels), (deal_unit, best[1] + extra, move_s)
    if best_k == 0 and not pool.held.any():
        return nothing
    unit, gain, move_s = best
    return _apply(offers, pool, unit, best_k, gain, move_s, offered, dealt)


def _may_deal(config: PlannerConfig) -> bool:
    """The deal (migration_deal.py) prices groups by the greedy fill of padded rows: min-time's
    cut, without a patch budget (which cuts elsewhere) or packed rows (which do not pad)."""
    return (
        config.grouping is Grouping.MIN_TIME
        and config.collate is Collate.PADDED
        and config.max_patches == 0
    )


def _dealt(pool: _Pool, base: IntArray, config: PlannerConfig, flush: bool) -> IntArray:
    """`base` with the groups of one balanced in blocks of W and every other live sample dealt
    (migration_deal.deal); in the flush, every node's total work then evened (_equalize)."""
    unit = base.copy()
    _balance_levels(pool, unit, range(pool.singleton_levels), config.num_units)
    ordinary = np.flatnonzero(~pool.singleton & ~pool.held)
    dealt = deal(pool.lengths[ordinary], config.token_budget, config.num_units)
    _, classes = np.unique(pool.work[ordinary], return_inverse=True)
    unit[ordinary] = fewest_moves(classes, pool.unit[ordinary], dealt, config.num_units)
    if flush:
        _equalize(pool, unit, config.num_units)
    return unit


def _candidates(pool: _Pool) -> list[int]:
    """Numbers of levels to balance, costliest first: the groups of one alone, then with the
    costliest 2, 4, ... of the equal-work bins."""
    s = pool.singleton_levels
    out = [s] if s else []
    out += [s + k for k in WORK_CANDIDATES if s + k <= len(pool.levels)]
    if not out or out[-1] < len(pool.levels):
        out.append(len(pool.levels))
    return sorted(set(k for k in out if k > 0))


def _sample_bytes(
    offers: Sequence[UnitOffer], link: LinkModel, given: Sequence[IntArray] | None
) -> list[IntArray]:
    if given is None:
        return [np.ceil(o.samples.lengths * link.bytes_per_token).astype(np.int64) for o in offers]
    out = [np.asarray(b, dtype=np.int64) for b in given]
    for o, b in zip(offers, out, strict=True):
        if b.shape != o.samples.views.shape:
            raise InvariantError(f"unit {o.unit}: {b.shape[0]} sizes for {len(o.samples)} samples")
    return out


def _unchanged(offers: Sequence[UnitOffer], offered: int) -> MigrationPlan:
    z = np.zeros(0, dtype=np.int64)
    return MigrationPlan(tuple(offers), z, z, z, z, 0, 0.0, 0.0, offered)


@dataclass(frozen=True, slots=True)
class _Pool:
    """Every offered sample, costliest first (ties: the units interleaved)."""

    unit: IntArray  # (n,) source unit
    row: IntArray  # (n,) row in its unit's table
    work: np.ndarray  # (n,) float64 one-sample work
    lengths: IntArray
    patches: IntArray
    nbytes: IntArray
    singleton: np.ndarray  # (n,) bool: no other sample fits beside it (a group of one)
    held: np.ndarray  # (n,) bool: waits for the next round (HOLD_SPREAD)
    levels: list[IntArray]  # pool positions of each level, costliest level first
    chunks: list[int]  # per level: a unit's share is a multiple of this (G for groups of one)
    singleton_levels: int  # the first this many levels hold the groups of one
    budget: int
    ranks: int

    @property
    def n(self) -> int:
        return int(self.unit.shape[0])

    @staticmethod
    def of(
        offers: Sequence[UnitOffer],
        sizes: list[IntArray],
        config: PlannerConfig,
        works: Sequence[np.ndarray] | None = None,
        ties: Sequence[IntArray] | None = None,
    ) -> _Pool:
        tables = [o.samples for o in offers]
        unit = np.concatenate([np.full(len(o.samples), o.unit, np.int64) for o in offers])
        row = np.concatenate([np.arange(len(t), dtype=np.int64) for t in tables])
        lengths = np.concatenate([t.lengths for t in tables])
        ages = np.concatenate([t.ages for t in tables])
        patches = np.concatenate([t.patches for t in tables])
        nbytes = np.concatenate(sizes)
        if works is None:
            work = np.asarray(
                config.cost.work(
                    lengths.astype(np.float64), lengths.astype(np.float64) ** 2, patches
                ),
                dtype=np.float64,
            )
        else:
            work = np.concatenate([np.asarray(w, dtype=np.float64) for w in works])
        tie = row if ties is None else np.concatenate([np.asarray(t, np.int64) for t in ties])
        if work.shape != unit.shape or tie.shape != unit.shape:
            raise InvariantError(
                f"{work.shape[0]} works, {tie.shape[0]} ties for {unit.shape[0]} samples"
            )
        # Ties interleave the units (row within its unit, then unit), so equal samples of a
        # level are already spread evenly and do not move back and forth between bins.
        order = np.lexsort((unit, tie, -work))
        unit, row, work, lengths, patches, nbytes, ages = (
            x[order] for x in (unit, row, work, lengths, patches, nbytes, ages)
        )
        half = config.token_budget // 2
        # Padded or packed alike, two samples longer than L/2 never share a group.
        singleton = lengths > half
        g = config.ranks_per_unit
        block = g * config.num_units
        flush = all(o.dry for o in offers)
        held = _holds(work, singleton, lengths > config.token_budget, ages, block, flush)
        # Groups of one in blocks of W (G per node): each node's k-th run of G is then the k-th
        # block's share, and step k runs W neighbours of the round's sorted order.
        single = np.flatnonzero(singleton & ~held)
        levels = [single[i : i + block] for i in range(0, len(single), block)]
        rest = np.flatnonzero(~singleton & ~held)
        bins = _levels(work[rest], config.num_units)
        cuts = np.flatnonzero(np.diff(bins)) + 1
        work_levels = [x for x in np.split(rest, cuts) if x.size]
        return _Pool(
            unit, row, work, lengths, patches, nbytes, singleton, held, levels + work_levels,
            [g] * len(levels) + [1] * len(work_levels), len(levels), config.token_budget, g,
        )  # fmt: skip


def _holds(
    work: np.ndarray,
    singleton: np.ndarray,
    outsized: np.ndarray,
    ages: IntArray,
    block: int,
    flush: bool,
) -> np.ndarray:
    """Which groups of one wait a round, in a round holding a sample over the budget: walking
    them costliest first, a block of the next `block` whose cheapest is within HOLD_SPREAD of its
    costliest runs (one step's worth); otherwise the costliest waits, unless it has waited
    HOLD_ROUNDS already, in which case its block runs with it. What is left after the walk, a
    partial block (fewer than `block`), waits
    too, but only if a whole block ran in this round (and, as any hold, for at most HOLD_ROUNDS):
    in the next round it meets that round's arrivals instead of running beside the round's
    ordinary groups, a step as long as its costliest on one node while the others run less.

    Why only beside a whole block (DESIGN.md section 3.3, O(N/W + D) rounds per epoch): a round
    that holds its partial block runs at least `block` = W groups of one, a full step of the
    world, so at most (groups of one in the epoch) / W <= N/W rounds can hold one, and a round
    never holds everything it was offered (T >= 1, alignment.min_time_target_steps). Held
    unconditionally, a partial block of groups of one could wait round after round while it was
    all the world had left: 24 ranks in 12 nodes of buffer 1, 4 groups of one among 153
    samples, took 13 rounds against the bound's 11 (tests/unit/test_planner_migration.py;
    test_planner_properties.py::test_join_mode_properties found 36 against 19), since a node
    whose buffer holds only waiting samples takes no arrivals and the epoch cannot end until it
    is dry. Heavy tail W = 16 / 128 / 1024: 0.9924 / 0.9899 / 0.9883 of the global oracle with
    the partial block running and HOLD_SPREAD 2 % -> 0.9930 / 0.9913 / 0.9898 with it waiting
    beside a whole block at 0.5 %, over-budget 0.9941 / 0.9926 / 0.9917 -> 0.9953 / 0.9940 /
    0.9933 (docs/bench/migration.md, "How it got there").

    Why an aged group of one takes its block along: run alone, it shifted the cut of every
    block below it in the round (what runs is cut into blocks of W in cost order), so in an
    epoch longer than HOLD_ROUNDS rounds each round's aged few made every block of the round
    ragged. Heavy tail, 125,000 samples per rank at W = 16 (~130 rounds): efficiency 0.9765
    with the aged run alone, 0.9896 with its block (no holds: 0.9742); 50,000 per rank at W = 128
    (~53 rounds): 0.9789 -> 0.9872. Epochs of fewer rounds than HOLD_ROUNDS (the bench's 13)
    are unchanged.

    Why every group of one and not only those over the budget: the oracle's steps of groups of
    one hold W of nearly equal cost world-wide; a round's walk over the giants alone ran the
    samples in (L/2, L] in blocks of any spread, and the giants' last partial block beside
    them. Rounds without a giant hold nothing: there holding the groups of one lost sharegpt4o
    0.0001 at W = 128 and gained nothing."""
    held = np.zeros(work.shape, dtype=bool)
    if flush or not bool(outsized.any()):
        return held
    big = np.flatnonzero(singleton)
    p, ran_block = 0, False
    while p + block <= big.size:
        first, last = work[big[p]], work[big[p + block - 1]]
        if last >= (1 - HOLD_SPREAD) * first or ages[big[p]] >= HOLD_ROUNDS:
            # An aged one runs with its block, not alone: alone it would shift every block cut
            # below it (step 1 cuts what runs into blocks of W in cost order).
            p, ran_block = p + block, True
        else:
            held[big[p]] = True
            p += 1
    if ran_block:
        tail = big[p:]
        held[tail] = ages[tail] < HOLD_ROUNDS
    return held


def _levels(work: np.ndarray, num_units: int) -> IntArray:
    """Bin of every sample (sorted costliest first): LEVELS bins of equal work, a bin closed only
    once it holds a sample per unit (a bin of fewer cannot be dealt evenly)."""
    n = int(work.shape[0])
    cum = np.cumsum(work)
    total = float(cum[-1]) if n else 0.0
    if total <= 0:
        return np.zeros(n, np.int64)
    by_work = np.minimum((cum - work) * LEVELS // total, LEVELS - 1).astype(np.int64)
    candidates = np.flatnonzero(np.diff(by_work)) + 1  # first position of each work bin
    starts = [0]
    for c in candidates.tolist():
        if c - starts[-1] >= num_units and n - c >= num_units:
            starts.append(c)
    level = np.zeros(n, np.int64)
    level[np.asarray(starts[1:], dtype=np.int64)] = 1
    return np.cumsum(level)


def _balance_levels(pool: _Pool, unit: IntArray, levels: range, num_units: int) -> None:
    """Moves samples of `levels` (in `unit`, in place) so every unit holds its share of each:
    the level's count over the units in whole chunks, the units holding the most keeping the
    remainder (fewest moves; ties: lower unit); a unit over its share sends its cheapest."""
    for lv in levels:
        idx = pool.levels[lv]
        chunk = pool.chunks[lv]
        counts = np.bincount(pool.unit[idx], minlength=num_units)
        chunks, tail = divmod(int(idx.size), chunk)
        base, extra = divmod(chunks, num_units)
        by_most = np.lexsort((np.arange(num_units), -counts))
        target = np.full(num_units, base * chunk, np.int64)
        target[by_most[:extra]] += chunk
        target[by_most[extra % num_units]] += tail
        surplus = counts - target
        if not surplus.any():
            continue
        outgoing: list[int] = []
        for u in np.flatnonzero(surplus > 0):
            mine = idx[pool.unit[idx] == u]
            outgoing.extend(mine[len(mine) - int(surplus[u]) :].tolist())  # its cheapest
        slots = np.repeat(np.arange(num_units), np.maximum(-surplus, 0))
        if len(slots) != len(outgoing):
            raise InvariantError(f"level {lv}: {len(outgoing)} samples for {len(slots)} places")
        unit[np.asarray(outgoing, np.int64)] = slots


def _equalize(pool: _Pool, unit: IntArray, num_units: int) -> None:
    """The flush's every-node work made equal (in `unit`, in place): nodes over the mean send
    their cheapest samples that share groups (the pool's cheapest EQUALIZE_SHARE of them) to
    the nodes furthest under it, while a move brings both nearer the mean.

    Why: in the flush every node runs all it holds in the same T steps, so the busiest node's
    total sets them all; balancing each cost level's count left nodes' totals 0.99-1.012 of
    the mean at longtail W = 1024 (a level's samples differ in work, its remainder goes to the
    nodes holding most). Earlier rounds run T full steps and recirculate the rest, so their
    totals matter less and nothing is equalized there."""
    live = ~pool.held
    totals = np.bincount(unit[live], weights=pool.work[live], minlength=num_units)
    mean = float(totals.mean())
    shared = np.flatnonzero(live & ~pool.singleton)
    cheap = shared[int(shared.size * (1 - EQUALIZE_SHARE)) :][::-1]  # cheapest first
    if cheap.size == 0:
        return
    short = [(float(totals[v]) - mean, v) for v in range(num_units) if totals[v] < mean]
    heapq.heapify(short)  # the node furthest under the mean first
    for u in np.argsort(-totals, kind="stable").tolist():
        if totals[u] <= mean:
            break
        for p in cheap[unit[cheap] == u].tolist():
            w = float(pool.work[p])
            if not short or totals[u] - mean < w / 2 or -short[0][0] < w / 2:
                break
            _, v = heapq.heappop(short)
            unit[p] = v
            totals[u] -= w
            totals[v] += w
            if totals[v] < mean:
                heapq.heappush(short, (float(totals[v]) - mean, v))


def _estimate(unit: IntArray, pool: _Pool, config: PlannerConfig, cut: bool = False) -> float:
    """The round's time in work units, roughly: every node deals its groups of one (samples over
    L/2) in runs of G costliest first, step k lasting the costliest node's k-th run; the rest is
    fluid, each node's remaining work spread over its G ranks; plus c per step, the steps being
    the busiest node's groups / G. With `cut`, the rest is the work of the groups each node's
    greedy cut makes of it (padding included; migration_deal.cut_work) and counts them."""
    g, nodes = pool.ranks, config.num_units
    singles = np.flatnonzero(~pool.held & pool.singleton)  # costliest first (the pool's order)
    owner = unit[singles]
    per_node = np.bincount(owner, minlength=nodes)
    by_node = np.argsort(owner, kind="stable")
    rank = np.empty(owner.size, dtype=np.int64)  # within its node's groups of one
    rank[by_node] = np.arange(owner.size) - np.repeat(np.cumsum(per_node) - per_node, per_node)
    leads = rank % g == 0  # the costliest of each run of G
    tail = np.zeros(-(-int(per_node.max(initial=0)) // g))
    np.maximum.at(tail, rank[leads] // g, pool.work[singles[leads]])
    ordinary = ~pool.held & ~pool.singleton
    if cut:
        work, count = cut_work(
            unit[ordinary], pool.lengths[ordinary], pool.patches[ordinary], nodes,
            pool.budget, config.cost,
        )  # fmt: skip
        rest, groups = work / g, per_node + count
    else:
        mine = unit[ordinary]
        rest = np.bincount(mine, weights=pool.work[ordinary], minlength=nodes) / g
        tokens = np.bincount(mine, weights=pool.lengths[ordinary], minlength=nodes)
        groups = per_node + tokens / pool.budget
    steps = float(np.ceil(groups.max() / g))
    return float(config.cost.c * steps + tail.sum() + rest.max())


def _move_seconds(pool: _Pool, unit: IntArray, nodes: int, link: LinkModel) -> float:
    moved = unit != pool.unit
    if not moved.any():
        return 0.0
    out = np.bincount(pool.unit[moved], weights=pool.nbytes[moved], minlength=nodes)
    into = np.bincount(unit[moved], weights=pool.nbytes[moved], minlength=nodes)
    return float(np.maximum(out, into).max() / link.bytes_per_s)


def _apply(
    offers: Sequence[UnitOffer],
    pool: _Pool,
    unit: IntArray,
    bins: int,
    gain: float,
    move_s: float,
    offered: int,
    dealt: bool,
) -> MigrationPlan:
    moved = np.flatnonzero(unit != pool.unit)
    waiting = np.flatnonzero(pool.held)
    tables = [o.samples for o in offers]
    staying: list[IntArray] = []
    held: list[SampleTable] = []
    for o, t in zip(offers, tables, strict=True):
        keep = np.ones(len(t), dtype=bool)
        keep[pool.row[moved[pool.unit[moved] == o.unit]]] = False
        mine = pool.row[waiting[pool.unit[waiting] == o.unit]]
        keep[mine] = False
        held.append(t.take(np.sort(mine)).aged())
        staying.append(keep)
    new_offers = []
    for o, t, keep in zip(offers, tables, staying, strict=True):
        arriving = moved[unit[moved] == o.unit]
        parts = [t.take(np.flatnonzero(keep))]
        for src in np.unique(pool.unit[arriving]):
            rows = pool.row[arriving[pool.unit[arriving] == src]]
            parts.append(tables[int(src)].take(rows))
        new_offers.append(UnitOffer(o.unit, SampleTable.concat_all(parts), o.dry))
    views = np.concatenate([t.views for t in tables])
    starts = np.cumsum([0] + [len(t) for t in tables[:-1]])
    moved_views = views[starts[pool.unit[moved]] + pool.row[moved]]
    return MigrationPlan(
        tuple(new_offers),
        moved_views,
        pool.unit[moved],
        unit[moved],
        pool.nbytes[moved],
        bins,
        gain,
        move_s,
        offered,
        tuple(held),
        dealt,
    )
