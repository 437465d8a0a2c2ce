"""company.py: a unit's costliest fresh groups wait a round when that brings its cost profile
closest to the round's median profile."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.planner import company
from odbd.planner.round import plan_round
from tests.unit.planner_factories import make_config, make_offers


def _brute_force(cost, fresh, max_waits, reference):
    order = np.argsort(-cost, kind="stable")
    removable = np.flatnonzero(fresh[order])[:max_waits]
    distances = []
    for s in range(len(removable) + 1):
        kept = np.delete(cost[order], removable[:s])[: len(reference)]
        distances.append(np.abs(kept - reference).sum())
    best = int(np.argmin(np.round(distances, 6)))
    wait = np.zeros(len(cost), dtype=bool)
    wait[order[removable[:best]]] = True
    return wait


@settings(max_examples=80, deadline=None)
@given(
    costs=st.lists(st.integers(1, 50), min_size=2, max_size=40),
    fresh_bits=st.lists(st.booleans(), min_size=40, max_size=40),
    slots=st.integers(1, 30),
    max_waits=st.integers(0, 12),
    reference=st.lists(st.integers(0, 50), min_size=30, max_size=30),
)
def test_the_one_gather_search_matches_dropping_groups_one_by_one(
    costs, fresh_bits, slots, max_waits, reference
):
    cost = np.asarray(costs, dtype=np.float64)
    fresh = np.asarray(fresh_bits[: len(cost)])
    depth = min(slots, len(cost) - 1)
    surplus = min(len(cost) - depth, max_waits)
    ref = np.asarray(reference[:depth], dtype=np.float64)
    order = np.argsort(-cost, kind="stable")
    got = company._closest_shift(cost, fresh, order, surplus, ref)
    assert got.tolist() == _brute_force(cost, fresh, surplus, ref).tolist()


def test_a_unit_with_extra_giants_holds_back_fresh_ones_only():
    giant, full = 40.0, 10.0
    # Four units, four slots each; unit 0 has three giants (one already recirculated), the others
    # one each: unit 0's second and third giant would run beside the others' ordinary groups.
    costs = [np.array([giant, giant, giant, full, full, full, full, full])] + [
        np.array([giant, full, full, full, full, full]) for _ in range(3)
    ]
    fresh = [np.array([False, True, True, True, True, True, True, True])] + [
        np.ones(6, dtype=bool) for _ in range(3)
    ]
    waits = company.waiting_groups(costs, fresh, num_slots=4, max_waits=8)
    assert waits[0].tolist() == [False, True, True, False, False, False, False, False]
    assert not any(w.any() for w in waits[1:])
    # No surplus, no wait: T * G slots must all be filled from the unit's own groups.
    assert not company.waiting_groups(costs, fresh, num_slots=8, max_waits=8)[0].any()
    assert not company.waiting_groups(costs, fresh, num_slots=4, max_waits=0)[0].any()


def test_plan_round_recirculates_the_waiting_giant_with_its_age_counted():
    # Three nodes of one rank, budget 1000, exact sort. Node 0 has two 5000-token giants, the
    # others one: each cuts its giants, two singles of 900 and four groups of 4 x 250.
    config = replace(make_config(world=3, per_node=1, budget=1000, buffer=64), fresh_groups=False)
    node0 = [5000, 5000] + [250] * 16 + [900] * 2
    other = [5000] + [250] * 16 + [900] * 2
    plan = plan_round(make_offers(config, [node0, other, other]), config, 0)
    # T = 7 (the others' group count); node 0 has 8 and recirculates one: its second giant waits
    # for company rather than run beside the others' 900s (its age counts from now on).
    assert plan.num_steps == 7
    assert plan.units[0].leftover.lengths.tolist() == [5000]
    assert plan.units[0].leftover.ages.tolist() == [1]
    giant_steps = (plan.stats.padded_tokens > 1000).any(axis=1)
    assert int(giant_steps.sum()) == 1  # the three kept giants share one step


@settings(max_examples=80, deadline=None)
@given(costs=st.lists(st.integers(0, 6), min_size=1, max_size=60), count=st.integers(1, 70))
def test_costliest_first_is_a_prefix_of_the_full_stable_sort(costs, count):
    cost = np.asarray(costs, dtype=np.float64)
    full = np.argsort(-cost, kind="stable")
    got = company._costliest_first(cost, count)
    assert len(got) >= min(count, len(cost))
    assert got.tolist() == full[: len(got)].tolist()
