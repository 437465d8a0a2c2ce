"""EpochEnd.num_identities over every node (planner/identities.py): each node sends per step its
count of views whose identity occurs once in the iteration and the identities of the repeated
ones; the hub sums and unites; the fold is the number of distinct identities emitted, however
the views are split across nodes and steps, reordered or cut, encoded, or journaled."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.daemon import split_round
from odbd.daemon.journal import Journal, replay
from odbd.planner.completion import RoundTotals
from odbd.planner.identities import (
    EpochIdentities,
    IdentitySource,
    StepIdentities,
    repeated_views,
    unite,
)
from odbd.planner.sampler import num_views, sampler_identities


@st.composite
def emitted_split(draw):
    """A dataset, a world, an iteration, the views emitted (each at most once) and for each
    the (node, step) that emitted it."""
    n = draw(st.integers(1, 40))
    world = draw(st.integers(1, 9))
    iteration = draw(st.integers(0, 3))
    m = num_views(n, world)
    views = draw(st.lists(st.integers(0, m - 1), unique=True, max_size=m))
    nodes, steps = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    where = [(draw(st.integers(0, nodes - 1)), draw(st.integers(0, steps - 1))) for _ in views]
    seed = draw(st.integers(0, 2**31))
    return n, world, iteration, m, views, nodes, steps, where, seed


def _node_parts(case):
    n, world, iteration, m, views, nodes, steps, where, seed = case
    ids = sampler_identities(n, world, seed=seed, epoch=iteration)
    source = IdentitySource(n, m, lambda keys: ids[keys % m])
    parts = []
    for node in range(nodes):
        step_keys = [
            np.asarray(
                [iteration * m + v for v, w in zip(views, where, strict=True) if w == (node, s)],
                dtype=np.int64,
            )
            for s in range(steps)
        ]
        parts.append(source.of_steps(step_keys))
    return ids, parts


def _fold(emitted: StepIdentities, steps) -> int:
    tally = EpochIdentities()
    for s in steps:
        tally.fold(*emitted.of_step(s))
    return tally.count


@settings(max_examples=300, deadline=None)
@given(emitted_split())
def test_the_count_is_the_distinct_identities_of_the_emitted_views_over_any_split(case):
    n, world, iteration, m, views, nodes, steps, where, seed = case
    ids, parts = _node_parts(case)
    combined = unite(parts, steps)
    assert _fold(combined, range(steps)) == len(set(ids[views].tolist()))
    # a prefix of the steps counts the views of those steps only
    kept = steps // 2
    prefix = {v for v, w in zip(views, where, strict=True) if w[1] < kept}
    cut = combined.take(np.arange(kept))
    assert _fold(cut, range(kept)) == len(set(ids[sorted(prefix)].tolist()))


@settings(max_examples=100, deadline=None)
@given(emitted_split(), st.randoms(use_true_random=False))
def test_reordering_steps_and_the_round_payloads_keep_the_count(case, rng):
    n, world, iteration, m, views, nodes, steps, where, seed = case
    ids, parts = _node_parts(case)
    order = np.asarray(rng.sample(range(steps), steps), dtype=np.int64)
    combined = unite(parts, steps).take(order)
    assert _fold(combined, range(steps)) == len(set(ids[views].tolist()))
    # through the hub's two codecs (a node's extras in, the round's extras out)
    zeros = np.zeros(steps)
    extras = split_round.RoundExtras(0, 0, 0, zeros, zeros, combined)
    totals = RoundTotals(np.ones(steps, np.int64), np.ones(steps, np.int64), np.zeros(0), False)
    payload = split_round.encode_round_totals(totals, extras)
    back = split_round.decode_round_totals(payload, steps)[1].step_identities()
    assert back.singles.tolist() == combined.singles.tolist()
    assert back.repeated.tolist() == combined.repeated.tolist()


@given(st.integers(1, 50), st.integers(1, 9))
def test_repeated_views_are_those_of_identities_at_several_views(n, world):
    ids = sampler_identities(n, world, seed=3, epoch=1)
    m = len(ids)
    counts = np.bincount(ids, minlength=n)
    keys = np.arange(2 * m, dtype=np.int64)  # two iterations' keys
    assert repeated_views(keys, n, m).tolist() == (counts[ids[keys % m]] > 1).tolist()
    if m - n <= n:  # the padding repeats m - n identities once each: 2 (m - n) such views
        assert int(repeated_views(keys[:m], n, m).sum()) == 2 * (m - n)


def test_the_journal_keeps_every_nodes_identities_per_step(tmp_path):
    journal = Journal(tmp_path, 0)
    journal.open({"job": "x"}, 10)
    counts = np.asarray([[1, 0], [1, 0]])
    journal.append_round(
        0, [[0, 0, 5], [0, 1, 4]], np.asarray([1, 2]), counts.reshape(-1), [], {},
        [[4, [7]], [3, []]],
    )  # fmt: skip
    journal.append_round(1, [[0, 2, 2]], np.asarray([3]), np.asarray([1, 0]), [], {})  # older
    state = replay(journal.records(), world_size=2, epoch=0, step=3)
    assert [s.identities for s in state.trained_steps] == [(4, (7,)), (3, ()), None]
    journal.close()
