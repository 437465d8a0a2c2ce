"""Costly groups wait for company under one shared cap profile (min-time; issue 14, item 1).

A step lasts as long as its costliest group, and every unit gives each step G groups from its
own buffer (data stays on its node), the k-th costliest run of G on every unit sharing step k
(assignment.py). For a fixed set of groups that is the best placement (simulate/oracle.py,
`node_local_bound`); what a round loses is in the set: at every cost level x a round needs
max over units of ceil(n_u(x) / G) steps costing >= x, where n_u(x) counts unit u's groups
costing >= x. One round holds a few costly groups per unit (a Pareto tail: ~40 per 8,192
samples), a different few on every unit, so the unit with the most sets the steps at every
level while the others run cheaper groups beside it. The node-local oracle, which sorts a whole
epoch per node, pays that once per epoch instead of once per round.

So each round every unit runs its costly groups only as deep as a shared cap allows:

1. cap (every daemon, from the summaries' profiles): at each profile position j, the
   CAP_QUANTILE-quantile over units of their j-th costliest group, then taken at the last
   position of j's run of G, so a run's cap is what a quarter of the units can fill whole
   (PACING_SLACK higher in a round without a giant, so near-equal ordinary groups run);
2. hold (each unit on its node): walking its groups costliest first, a group that costs more
   than the cap at the next free position waits (recirculated, sorted again with the next
   round's arrivals); the rest run. Every daemon computes each unit's held count from its
   profile (`held_counts`) and takes T from the groups every unit can run without them, so
   holding never forces a split (past CAP_SAMPLE_UNITS units, every k-th unit's; a unit left
   out that lacks room runs its cheapest held groups).

Bounds: a group whose samples were recirculated MAX_HOLD_ROUNDS times runs whatever the cap
says (the unit then runs more than the others counted, which only adds surplus), so a sample
waits at most that many rounds and DESIGN.md section 3.3's O(N/W + D) rounds keeps its form;
nothing waits once a unit is dry (the epoch's last rounds drain).

Which rounds are capped: with CAP_EVERY_ROUND_UNITS units or more, every round while all units
fill; with fewer, only rounds with a sample over the budget (a giant). Without giants the same
rule paces ordinary groups: a unit whose buffer holds more long-sample groups (costlier, by
b * l^2) than the quantile unit's runs them in later rounds, so no unit is the slowest of every
step of a round while its ranks idle in another; that loss grows with the units (W=1024,
sharegpt4o: the sum over rounds of the slowest node's work exceeded the slowest node's epoch
work by 0.93 % of the epoch's time). With two units the quantile is the smaller and capping
every round cost sharegpt4o 0.2 % and all-short 0.9 % at W=16, so few units keep the giant
rule. Measured odbd/node-local with the cap in every round (before: giants only, depth 256):
sharegpt4o 0.986 -> 0.991 and trimodal 0.989 -> 0.994 at W=1024; 0.989 -> 0.992 and
0.993 -> 0.995 at W=128 (docs/bench/planner.md, second pass).

The numbers below are odbd/node-local oracle on bench-planner's workloads at W=128 (reproduce
one by setting the constant and running the oracle table with ODBD_BENCH_ORACLE_WORLDS=128);
before this cap (the median-profile search it replaced) the heavy tail measured 0.959 and 3 %
over the budget 0.974.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from odbd.planner.config import PlannerConfig
from odbd.planner.types import FloatArray, IntArray

# Profile positions compared, i.e. the costliest groups a summary carries (8 bytes each):
# depth 32 / 64 / 128 / 256 gave 0.959 / 0.973 / 0.974 / 0.975 on the heavy tail, and
# 64 / 128 / 256 gave 0.976 / 0.979 / 0.984 over the budget (~245 giants per unit and round).
# Capping every round needs most of a unit's groups (~1,140 a round on sharegpt4o at buffer
# 1024): depth 256 / 512 / 1024 / 2048 gave 0.958 / 0.961 / 0.964 / 0.964 efficiency on
# sharegpt4o at W=1024, every unit sampled (over the budget: 0.962 at 256, 0.966 / 0.967 at
# 512 / 1024).
PROFILE_DEPTH = 1024
# Units from which every filling round is capped, not only rounds with a giant (see above).
CAP_EVERY_ROUND_UNITS = 4
# Which quantile of the units' profiles caps a position (0 = the unit with the fewest costly
# groups): 0.1 / 0.25 / 0.5 gave 0.971 / 0.973 / 0.970 on the heavy tail (depth 64).
CAP_QUANTILE = 0.25
# Rounds a group may wait: 6 / 12 gave 0.969 / 0.973 at depth 64, 8 / 12 gave 0.975 / 0.974 at
# depth 256 (fewer rounds force giants out while the other units have none to match them).
MAX_HOLD_ROUNDS = 8
# In rounds without a giant the cap only paces ordinary groups, whose costs mostly differ by
# the budget's rounding (l x floor(L / l) of L, a few tenths of a percent): a group within this
# fraction of the cap runs (`pacing_cap`). Exact, all-short at W=128 held ~half its groups
# every round over cost differences under 0.5 % (T = 2 where its groups fill 4). odbd/oracle
# on bimodal at W = 128 and 1024 (docs/bench/planner.md, fourth pass): 0.9913 and 0.9896
# exact; slack 0.001 / 0.0015 / 0.002 / 0.003: 0.9919 / 0.9919 / 0.9922 / 0.9922 and
# 0.9900 / 0.9902 / 0.9902 / 0.9901. Of these, 0.0015 alone lowered no row of the oracle table
# (0.002: uniform-narrow at W=128 0.99199 -> 0.99181); 1 % and 3 % lost sharegpt4o 0.2 % at
# W=128 (second pass). Giant rounds keep the exact cap: 0.001 / 0.002 on their ordinary
# positions lost the heavy tail 0.1 % at W=128.
PACING_SLACK = 0.0015
# Units whose profiles set the cap and T, every k-th from unit 0 past this many (W > 512);
# only their summaries carry a profile. The quantile of 64 units is as good a cap as that of
# all: at W=1024 (128 units) sampling 64 / all gave 0.963 / 0.964 efficiency on sharegpt4o and
# 0.934 / 0.932 on the heavy tail, and it keeps phase 1 (np.partition and held_counts over
# units x PROFILE_DEPTH) and the profiles every daemon receives (64 x 8 KiB a round) flat in W.
# A unit left out still holds by the cap on its node; one that lacks room for T steps without
# its held groups runs the cheapest of them (node_plan.py).
CAP_SAMPLE_UNITS = 64


def sampled_units(num_units: int) -> slice:
    """The units phase 1 reads profiles of: all, or every k-th from unit 0."""
    return slice(None, None, _sample_step(num_units))


def is_sampled(unit: int, num_units: int) -> bool:
    """Whether `unit` is one of sampled_units(num_units): its summary carries its profile."""
    return unit % _sample_step(num_units) == 0


def _sample_step(num_units: int) -> int:
    return max(-(-num_units // CAP_SAMPLE_UNITS), 1)


def outsized_work(config: PlannerConfig) -> float:
    """The most work a group within the budget can have (padded <= L, sum l^2 <= L^2, patches
    <= --max-patches): only groups above it, one sample longer than L, are capped."""
    budget = float(config.token_budget)
    return float(config.cost.work(budget, budget * budget, float(config.max_patches)))


def caps_every_round(config: PlannerConfig) -> bool:
    """Whether every filling round is capped (enough units), not only rounds with a giant."""
    return config.num_units >= CAP_EVERY_ROUND_UNITS


def cost_profile(cost: FloatArray, threshold: float, always: bool = False) -> FloatArray:
    """(<= PROFILE_DEPTH,) the unit's costliest groups' costs, descending, if any is outsized
    or `always` (caps_every_round); empty otherwise (no payload for buffers without a giant).

    Its ordinary groups count too: where the quantile unit runs ordinary groups, the cap holds
    back another unit's giants (outsized only: 0.971 on the heavy tail at W=128 vs 0.975).
    """
    cost = np.asarray(cost, dtype=np.float64)
    if not always and not bool((cost > threshold).any()):
        return np.zeros(0)
    return -np.sort(-cost)[:PROFILE_DEPTH]


def profile_matrix(profiles: Sequence[FloatArray]) -> tuple[FloatArray, IntArray]:
    """(units, longest profile) every unit's profile, zero past its end, and (units,) how many
    entries each has: the one array phase 1 reads."""
    lengths = np.asarray([min(len(p), PROFILE_DEPTH) for p in profiles], dtype=np.int64)
    width = int(lengths.max(initial=0))
    if len(profiles) and bool((lengths == width).all()):
        return np.stack([p[:width] for p in profiles], dtype=np.float64), lengths
    matrix = np.zeros((len(profiles), width))
    for u, profile in enumerate(profiles):
        matrix[u, : lengths[u]] = profile[: lengths[u]]
    return matrix, lengths


def cap_profile(matrix: FloatArray, ranks_per_unit: int, threshold: float) -> FloatArray:
    """(matrix width,) the cap at each position, non-increasing: where the quantile unit's
    profile ends, nothing costlier than its last capped group may run, and with no profile at
    all nothing over `threshold`. matrix: profile_matrix's of sampled_units'.

    np.partition picks a value of the matrix (no interpolation), the same on every daemon.
    """
    units, depth = matrix.shape
    if units == 0:
        return np.zeros(0)
    k = int(CAP_QUANTILE * (units - 1))
    g = max(ranks_per_unit, 1)
    run_end = np.minimum(np.arange(depth) // g * g + g - 1, depth - 1)
    # Only the quantile at each run's last position is read: partitioning those columns alone
    # (one contiguous row each) is ~7x faster than the whole matrix at 64 x 1024, same values.
    ends, run_of = np.unique(run_end, return_inverse=True)
    column = np.partition(np.ascontiguousarray(matrix[:, ends].T), k, axis=1)[:, k]
    cap = column[run_of]  # each row is non-increasing, so are its quantile and the cap
    # Past the quantile unit's profile, nothing costlier than its last capped group may run
    # (forward fill keeps the cap non-increasing); with no profile at all, nothing outsized.
    positive = np.flatnonzero(cap > 0)
    floor = cap[positive[-1]] if positive.size else threshold
    return np.where(cap > 0, cap, floor)


def pacing_cap(cap: FloatArray) -> FloatArray:
    """The cap of a round without a giant: PACING_SLACK above cap_profile's, still
    non-increasing (held_counts and unit_holds read it the same way on every daemon)."""
    return cap * (1.0 + PACING_SLACK)


def held_counts(matrix: FloatArray, lengths: IntArray, cap: FloatArray) -> IntArray:
    """(units,) how many groups each unit holds (`unit_holds` with nothing too old to wait);
    matrix and lengths as profile_matrix gives them, for every unit or sampled_units'.

    Walking costs c_0 >= c_1 >= ... against cap, the j-th group to run is the first after the
    (j-1)-th with c_i <= cap[j]: r_j = max(s_j, r_(j-1) + 1), s_j = #{i: c_i > cap[j]}, i.e.
    r_j = j + cummax(s_j - j). Every unit at once, exact comparisons only.

    The cap takes one value per run of G positions, and within a run [a, b) s_j - j is largest
    at j = a, so the cummax is taken over run starts: positions a..b-1 hold the groups
    a + M .. b - 1 + M, of which those below the unit's seen count run. Units x runs instead of
    units x positions (128 vs 1024 columns at G = 8).
    """
    units, depth = len(lengths), len(cap)
    if units == 0 or depth == 0:
        return np.zeros(units, dtype=np.int64)
    seen = np.minimum(lengths, depth)
    starts = np.flatnonzero(np.concatenate([[True], cap[1:] != cap[:-1]]))
    run_lengths = np.diff(np.append(starts, depth))
    exceeding = _counts_above(matrix, seen, cap[starts])  # (units, runs): s_a
    lead = np.maximum.accumulate(exceeding - starts, axis=1)  # M of each run
    running = np.clip(seen[:, None] - lead - starts, 0, run_lengths).sum(axis=1)
    return seen - running


def _counts_above(matrix: FloatArray, seen: IntArray, levels: FloatArray) -> IntArray:
    """(units, levels) #{i < seen[u]: matrix[u, i] > level}, each row descending."""
    descending = -matrix  # ascending rows: searchsorted counts the entries below -level
    negated = -levels
    above = np.empty((len(seen), len(levels)), dtype=np.int64)
    for u, n in enumerate(seen.tolist()):
        above[u] = descending[u, :n].searchsorted(negated, side="left")
    return above


def unit_holds(cost: FloatArray, ages: IntArray, cap: FloatArray, depth: int) -> np.ndarray:
    """(groups,) bool: True = this group waits (recirculated) this round.

    cost: the unit's group costs; ages: per group, the most rounds any member was recirculated.
    depth: the length of the unit's own profile. Only the groups it shows may wait: the other
    daemons count the holds from it (held_counts).
    """
    cost = np.asarray(cost, dtype=np.float64)
    hold = np.zeros(len(cost), dtype=bool)
    order = np.argsort(-cost, kind="stable")[: min(len(cap), depth)]
    may_wait = ages[order] < MAX_HOLD_ROUNDS
    if bool(may_wait.all()):
        hold[order] = _waiting(cost[order], cap)
    else:
        hold[order] = _walk_waiting(cost[order], may_wait, cap)
    return hold


def _waiting(costs: FloatArray, cap: FloatArray) -> np.ndarray:
    """(len(costs),) bool: which of a unit's groups, costliest first, wait under cap (as many
    positions or more) when none is too old to wait: all but the r_j of held_counts."""
    n = len(costs)
    exceeding = (-costs).searchsorted(-cap[:n], side="left")  # s_j
    position = np.arange(n)
    runs_at = position + np.maximum.accumulate(exceeding - position)
    waits = np.ones(n, dtype=bool)
    waits[runs_at[runs_at < n]] = False
    return waits


def _walk_waiting(costs: FloatArray, may_wait: np.ndarray, cap: FloatArray) -> np.ndarray:
    """_waiting when some groups waited MAX_HOLD_ROUNDS: those run wherever they fall, which
    breaks r_j's closed form, so walk them one by one (rare; on Python floats)."""
    waits = np.zeros(len(costs), dtype=bool)
    caps, position = cap.tolist(), 0
    for i, (c, ok) in enumerate(zip(costs.tolist(), may_wait.tolist(), strict=True)):
        if c > caps[position] and ok:
            waits[i] = True
        else:
            position += 1
    return waits
