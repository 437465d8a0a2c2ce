"""The offline oracle baseline: what min-time could do if it saw the whole epoch at once.

Per epoch it takes every sampler view (the same views odbd's join mode emits, tail padding
included; 0-length samples are rejected as at ingest), with no buffers, shards or rounds:

1. sort all lengths longest first and cut min-time groups greedily (the planner's own
   `group_buffer`, exact sort), so every group keeps the budget rule of DESIGN.md section 3.5;
2. price each group with the planner's cost model (a * padded + b * sum l^2);
3. sort the groups by cost and deal them W per step: step k holds the groups ranked
   k*W .. k*W + W - 1, so each step's groups cost about the same; the last step may be short
   (idle ranks).

Time = sum over steps of (c + the step's costliest group), as for every run. It is not a bound
(a step-count or cost-aware cut could beat it), but a planner that matches it has lost nothing to
being online. The result is StepStats, so `summarize` serves it like every baseline.

`node_oracle_stats` is the same oracle kept to node-local data (each node sees only its own
ranks' views, as odbd's node balance does, and step k takes every node's k-th costliest run of G
groups): the gap between the two oracles is what keeping data on its node costs, and the gap
between odbd and the node-local one is what planning round by round costs.

`node_local_bound` asks whether a better data-local plan than the node-local oracle exists: for
a fixed set of groups per node, no plan that keeps data on its node runs faster than
c * max_u ceil(groups_u / G) + max_u work_u / G (a step lasts at least as long as the mean work of
any one node's G ranks in it, and a rank runs one group per step). The node-local oracle's sorted
runs reach that bound up to the steps where the node with the most work is not the slowest.

`data_local_lower_bound` drops the fixed groups too: it bounds every plan that keeps each node's
views on that node, however it groups them and whether it plans online or offline, from the
lengths alone (each node's fewest groups and cheapest partition, by an exact dynamic
programme). Where it is below 0.99 of the global oracle's efficiency, no data-local planner (odbd
included) can reach 0.99 x the oracle: the gap is data locality, not planning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from odbd.errors import ConfigError
from odbd.planner.config import CostModel, Grouping, LossScaling
from odbd.planner.grouping import group_buffer
from odbd.planner.loss_scaling import loss_scales
from odbd.planner.sampler import sampler_identities, views_of_ranks
from odbd.planner.types import SampleTable, StepStats
from odbd.simulate.baselines import concat_stats


def oracle_stats(
    lengths: np.ndarray,
    *,
    world_size: int,
    budget: int,
    cost: CostModel,
    seed: int = 0,
    epochs: int = 1,
    shuffle: bool = True,
    tokens: np.ndarray | None = None,
    loss_scaling: LossScaling = LossScaling.EXACT,
) -> StepStats:
    """StepStats of shape (steps, W): `epochs` epochs, each planned from all its views at once."""
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens = lengths if tokens is None else np.asarray(tokens, dtype=np.int64)
    parts = []
    for epoch in range(max(epochs, 1)):
        views = sampler_identities(
            len(lengths), world_size, seed=seed, epoch=epoch, shuffle=shuffle
        )
        views = views[lengths[views] > 0]  # rejected at ingest, as odbd does
        parts.append(
            epoch_oracle_stats(
                lengths[views],
                tokens[views],
                world_size=world_size,
                budget=budget,
                cost=cost,
                loss_scaling=loss_scaling,
            )
        )
    return concat_stats(parts)


def epoch_oracle_stats(
    lengths: np.ndarray,
    tokens: np.ndarray,
    *,
    world_size: int,
    budget: int,
    cost: CostModel,
    loss_scaling: LossScaling = LossScaling.EXACT,
) -> StepStats:
    """One epoch's samples (all lengths >= 1) planned at once: groups dealt W per step by cost."""
    table = SampleTable.of(np.arange(len(lengths)), lengths, tokens)
    groups = group_buffer(table, budget, Grouping.MIN_TIME)  # no rng: the exact sort
    sorted_len = lengths[groups.order]
    per_group = {
        "num_samples": groups.sizes(),
        "num_tokens": _range_sums(tokens[groups.order], groups.starts, groups.ends),
        "real_tokens": _range_sums(sorted_len, groups.starts, groups.ends),
        "padded_tokens": _longest(sorted_len, groups.starts) * groups.sizes(),
        "sum_sq": _range_sums(sorted_len.astype(np.float64) ** 2, groups.starts, groups.ends),
    }
    work = cost.work(per_group["padded_tokens"], per_group["sum_sq"])
    by_cost = np.argsort(-work, kind="stable")
    num_steps = -(-len(by_cost) // world_size)

    def dealt(values: np.ndarray) -> np.ndarray:
        """(num_steps, W): the k-th costliest group at step k // W, rank k % W; idle = 0."""
        grid = np.zeros(num_steps * world_size, dtype=values.dtype)
        grid[: len(by_cost)] = values[by_cost]
        return grid.reshape(num_steps, world_size)

    num_samples, num_tokens = dealt(per_group["num_samples"]), dealt(per_group["num_tokens"])
    padded = dealt(per_group["padded_tokens"])
    no_estimate = np.zeros(world_size)  # only `approx` reads it; the oracle knows exact counts
    mode = LossScaling.EXACT if loss_scaling is LossScaling.APPROX else loss_scaling
    return StepStats(
        num_samples=num_samples,
        num_tokens=num_tokens,
        real_tokens=dealt(per_group["real_tokens"]),
        padded_tokens=padded,
        work=cost.work(padded, dealt(per_group["sum_sq"])),
        loss_scale=loss_scales(mode, num_samples, num_tokens, no_estimate),
    )


def _range_sums(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    csum = np.concatenate([np.zeros(1, dtype=values.dtype), np.cumsum(values)])
    return csum[ends] - csum[starts]


def _longest(sorted_longest_first: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """A group's first member is its longest (Groups' contract)."""
    return sorted_longest_first[starts] if len(starts) else np.zeros(0, dtype=np.int64)


def node_oracle_stats(
    lengths: np.ndarray,
    *,
    world_size: int,
    ranks_per_node: int,
    budget: int,
    cost: CostModel,
    seed: int = 0,
    shuffle: bool = True,
) -> StepStats:
    """One epoch, (steps, W): each node's views planned at once by `epoch_oracle_stats` with
    W = its G ranks; nodes with fewer steps idle at the end. Exact loss scales over all W."""
    per_node = [
        epoch_oracle_stats(node, node, world_size=ranks_per_node, budget=budget, cost=cost)
        for node in _lengths_by_node(lengths, world_size, ranks_per_node, seed, shuffle)
    ]
    num_steps = max(p.work.shape[0] for p in per_node)

    def stacked(name: str) -> np.ndarray:
        parts = [getattr(p, name) for p in per_node]
        return np.concatenate(
            [np.pad(x, ((0, num_steps - x.shape[0]), (0, 0))) for x in parts], axis=1
        )

    num_samples, num_tokens = stacked("num_samples"), stacked("num_tokens")
    return StepStats(
        num_samples=num_samples,
        num_tokens=num_tokens,
        real_tokens=stacked("real_tokens"),
        padded_tokens=stacked("padded_tokens"),
        work=stacked("work"),
        loss_scale=loss_scales(LossScaling.EXACT, num_samples, num_tokens, np.zeros(world_size)),
    )


@dataclass(frozen=True, slots=True)
class NodeLocalBound:
    """A lower bound on the time of any plan that runs the same groups with data kept local."""

    num_steps: int  # max over nodes of ceil(its groups / G): no node can run its groups in fewer
    step_overhead: float  # c * num_steps
    busiest_node_work: float  # max over nodes of (sum of its groups' work) / G
    # the bound: step_overhead + busiest_node_work (same units as Summary.simulated_time)
    simulated_time: float


def node_local_bound(stats: StepStats, *, ranks_per_node: int, cost: CostModel) -> NodeLocalBound:
    """The bound for the groups in `stats` ((steps, W), ranks in node order, an empty cell = an
    idle rank): why no data-local planner beats the node-local oracle by more than the gap."""
    steps, world = stats.work.shape
    if world % ranks_per_node:
        raise ConfigError(
            f"stats have {world} ranks, not a multiple of {ranks_per_node} ranks per node: pass "
            "the ranks_per_node the plan was made for"
        )
    by_node = (steps, world // ranks_per_node, ranks_per_node)
    groups = (stats.num_samples > 0).reshape(by_node).sum(axis=(0, 2))
    work = stats.work.reshape(by_node).sum(axis=(0, 2)) / ranks_per_node
    num_steps = int(-(-groups.max(initial=0) // ranks_per_node))
    return _bound(num_steps, float(work.max(initial=0.0)), cost)


@dataclass(frozen=True, slots=True)
class DataLocalBound:
    """A lower bound on one epoch's time for every plan that keeps each node's views on its
    node, whatever its groups, steps or rounds (same units as Summary.simulated_time)."""

    num_steps: int  # max over nodes of ceil(its fewest groups / G): the epoch has at least these
    simulated_time: float  # the bound, >= c * num_steps + any node's least work / G
    binding_node: int  # the node whose own samples give simulated_time


# Prices per group, as fractions of c, at which `data_local_lower_bound` trades a node's steps
# against its padding: every price gives a valid bound and the bound is concave in the price, so
# a coarse grid loses little (0 alone is c * num_steps + the busiest node's least work / G).
BOUND_PRICE_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def data_local_lower_bound(
    lengths: np.ndarray,
    *,
    world_size: int,
    ranks_per_node: int,
    budget: int,
    cost: CostModel,
    seed: int = 0,
    shuffle: bool = True,
) -> DataLocalBound:
    """No plan that runs each node's views on its own G ranks beats this, online or offline.

    Any such plan runs T steps, each at least c plus the mean work of any one node's G ranks in
    it (a rank runs one group per step), so time >= c * T + W_u / G for every node u, with W_u
    the work of u's groups (a * padded + b * sum l^2) and T >= ceil(groups_u / G). Node u's
    groups are some partition of its samples under the budget rule, so for a price y in [0, c]
    (c * max(T*, x) >= (c - y) * T* + y * x): time >= (c - y) * T* + min over u's partitions of
    (W_u + y * groups_u) / G, with T* = max over nodes of ceil(fewest groups / G). Both minima are
    exact (`least_group_costs`). A step lasts at least its longest group too, not only the
    node's mean: `outsized_excess` adds what that costs in the steps of u's samples over the
    budget. The bound is the largest over nodes and BOUND_PRICE_FRACTIONS.
    """
    nodes = _lengths_by_node(lengths, world_size, ranks_per_node, seed, shuffle)
    if not any(len(node) for node in nodes):
        return DataLocalBound(0, 0.0, 0)
    greedy = [_greedy_groups(node, budget, cost) for node in nodes]
    num_steps = -(-max(count for count, _ in greedy) // ranks_per_node)
    prices = cost.c * np.asarray(BOUND_PRICE_FRACTIONS)
    overhead = (cost.c - prices) * num_steps
    excess = [outsized_excess(node, budget, cost, ranks_per_node) for node in nodes]

    def at_most(node: int) -> float:
        """The node's bound if its cheapest partition were its greedy groups (an upper one)."""
        count, work = greedy[node]
        return float(np.max(overhead + (work + prices * count) / ranks_per_node)) + excess[node]

    best, binding = 0.0, 0
    # Nodes whose greedy groups already bound them below the best found cannot bind: skip their
    # dynamic programme (most nodes, since padding is a fraction of a percent of the work).
    for index in sorted(range(len(nodes)), key=lambda u: -at_most(u)):
        if at_most(index) <= best:
            break
        node = np.sort(nodes[index])[::-1]
        priced = least_group_costs(node, budget, cost, prices) / ranks_per_node
        node_bound = float(np.max(overhead + priced)) + excess[index]
        if node_bound > best:
            best, binding = node_bound, index
    return DataLocalBound(num_steps, best, binding)


def outsized_excess(
    lengths: np.ndarray, budget: int, cost: CostModel, ranks_per_node: int
) -> float:
    """How much the steps running this node's samples over the budget cost beyond the node's
    mean work in them, at least, in any plan: such a sample x is a group of one, so a step with
    the set S of them on this node lasts >= max(S) while the node's mean in it is at most
    (sum(S) + (G - |S|) * C) / G, C = a * L + b * L^2 bounding every group under the budget
    (padded <= L, sum l^2 <= L * longest <= L^2) and an idle rank. Summed over steps this is
    least for the outsized samples dealt G per step longest first (fewest steps, sorted runs)."""
    costs = np.sort(cost.work(*_giants(lengths, budget)))[::-1]
    if len(costs) == 0:
        return 0.0
    ceiling = float(cost.work(budget, float(budget) ** 2))
    runs = -(-len(costs) // ranks_per_node)
    fillers = runs * ranks_per_node - len(costs)
    total = float(costs[::ranks_per_node].sum() - costs.sum() / ranks_per_node)
    return total - fillers * ceiling / ranks_per_node


def _giants(lengths: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """(padded tokens, sum l^2) of each sample over the budget: a group of one."""
    over = lengths[lengths > budget].astype(np.float64)
    return over, over * over


def _greedy_groups(lengths: np.ndarray, budget: int, cost: CostModel) -> tuple[int, float]:
    """(groups, work) of min-time's greedy cut of these samples: the fewest groups of any
    partition under the budget rule (`least_group_costs` with a = b = 0 agrees), and a work no
    partition's least work exceeds."""
    table = SampleTable.of(np.arange(len(lengths)), lengths, lengths)
    groups = group_buffer(table, budget, Grouping.MIN_TIME)
    sorted_len = lengths[groups.order].astype(np.float64)
    padded = _longest(sorted_len, groups.starts) * groups.sizes()
    return len(groups), float(cost.work(padded.sum(), np.sum(sorted_len * sorted_len)))


def least_group_costs(
    lengths_longest_first: np.ndarray, budget: int, cost: CostModel, prices: np.ndarray
) -> np.ndarray:
    """For each price y: the least sum over groups of (a * padded + b * sum l^2 + y) over every
    partition of these samples into groups under the budget rule (padded area <= budget, or one
    sample alone). With a = b = 0 and y = 1, the fewest groups.

    Some best partition cuts the longest-first order into contiguous runs: give the k-th costliest
    group's size to the k-th run instead; its longest member is no longer, so it still fits and
    pads no more. Over contiguous runs this is a dynamic programme on F(p), the least cost of
    samples p.. when p starts a group. All groups starting among the samples of one length v
    (K = max(1, budget // v) per group) cover up to that length's end and t < K samples past
    it, so F(p) = a v r + y ceil(r / K) + min(min_{t <= q} G(t), y + min_{t > q} G(t)) with
    r samples of length v left from p, q = the free places of its ceil(r / K) groups and
    G(t) = a v t + F(end + t): one pass per distinct length, vectorised over the prices, and only
    the first K-of-the-previous-length positions of each length are ever a group's start.
    """
    lengths = np.asarray(lengths_longest_first, dtype=np.int64)
    prices = np.asarray(prices, dtype=np.float64)
    num = len(lengths)
    if num and np.any(lengths[1:] > lengths[:-1]):
        raise ConfigError("least_group_costs needs lengths sorted longest first (np.sort()[::-1])")
    change = np.flatnonzero(np.diff(lengths)) + 1
    run_starts = np.concatenate([[0], change]).astype(np.int64)
    run_ends = np.concatenate([change, [num]]).astype(np.int64)
    least = np.full((len(prices), num + 1), np.inf)
    least[:, num] = 0.0
    price_column = prices[:, None]
    for run in range(len(run_starts) - 1, -1, -1):
        start, end = int(run_starts[run]), int(run_ends[run])
        length = int(lengths[start])
        per_group = max(1, budget // length)
        # Only a group cut short by a longer length's K starts inside this run.
        previous = max(1, budget // int(lengths[start - 1])) if run else 1
        starts = np.arange(start, min(end, start + previous))
        past = min(per_group - 1, num - end)  # samples a group from this run can reach past it
        reach = cost.a * length * np.arange(past + 1) + least[:, end : end + past + 1]
        fill = np.minimum.accumulate(reach, axis=1)  # min over t <= q
        spill = np.full((len(prices), per_group), np.inf)  # min over q < t <= past
        if past:
            spill[:, :past] = np.minimum.accumulate(reach[:, :0:-1], axis=1)[:, ::-1]
        left = end - starts
        groups = -(-left // per_group)
        free = groups * per_group - left
        best = np.minimum(fill[:, np.minimum(free, past)], price_column + spill[:, free])
        least[:, starts] = cost.a * length * left + price_column * groups + best
    squares = cost.b * float(np.sum(lengths.astype(np.float64) ** 2))
    return least[:, 0] + squares


def _lengths_by_node(
    lengths: np.ndarray, world_size: int, ranks_per_node: int, seed: int, shuffle: bool
) -> list[np.ndarray]:
    """Per node, the lengths of its epoch-0 views (DistributedSampler order), zero lengths
    (rejected at ingest) left out."""
    lengths = np.asarray(lengths, dtype=np.int64)
    identities = sampler_identities(len(lengths), world_size, seed=seed, epoch=0, shuffle=shuffle)
    nodes = []
    for first in range(0, world_size, ranks_per_node):
        views = views_of_ranks(len(lengths), world_size, range(first, first + ranks_per_node))
        node = lengths[identities[views]]
        nodes.append(node[node > 0])
    return nodes


def _bound(num_steps: int, busiest: float, cost: CostModel) -> NodeLocalBound:
    return NodeLocalBound(num_steps, cost.c * num_steps, busiest, cost.c * num_steps + busiest)
