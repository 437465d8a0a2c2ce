"""The live split round (daemon/split_round.py): the hub decides once from the summaries and sums
the totals; each node, from those two small results and its own offers only, plans exactly its
part of plan_round's plan. What a node receives does not grow with the node count."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from odbd.daemon import payload_checks, split_round, split_updates, summary_codec
from odbd.errors import InvariantError
from odbd.planner import company
from odbd.planner.completion import RoundTotals
from odbd.planner.config import Align
from odbd.planner.round import assemble, plan_round, units_of_node
from odbd.planner.types import SampleTable, UnitOffer
from tests.unit.planner_factories import make_config
from tests.unit.test_split_plan import (
    SPLIT_SETTINGS,
    assert_same_decision,
    assert_same_plan,
    rounds,
)


def live_round(offers, config, round_index, side=lambda node: {}, extras_out=None):
    """Every node through both exchanges, the hub reducing each: (decision payload bytes,
    totals bytes, per-node DecisionPayload, per-node NodeRoundPlan)."""
    nodes = range(config.world.num_nodes)
    grouped, summaries = [], []
    for node in nodes:
        facts = summary_codec.NodeSummary(node, 0, (), **side(node))
        own = [offers[u] for u in units_of_node(config, node)]
        groups, payload = split_round.node_summary(facts, own, config, round_index)
        grouped.append(groups)
        summaries.append(payload)
    decided = split_round.hub_decide(summaries, config, round_index)
    seen = [split_round.decode_decision(decided, config) for _ in nodes]
    if seen[0].decision is None:
        return decided, b"", seen, []
    if config.align is Align.UPDATES:
        summed, done = _aligned_at_updates(grouped, seen, config)
    else:
        drafts, totals = [], []
        for node in nodes:
            decision = seen[node].decision
            draft, payload = split_round.node_totals(node, grouped[node], decision, config)
            drafts.append(draft)
            totals.append(payload)
        summed = split_round.hub_combine(totals, seen[0].decision.num_steps)
        done = [
            split_round.node_complete(drafts[n], seen[n].decision, summed, config) for n in nodes
        ]
    parts = [plan for plan, _ in done]
    for _, extras in done:
        assert_same_extras(extras, done[0][1])
    if extras_out is not None:
        extras_out.append(done[0][1])
    return decided, summed, seen, parts


def _aligned_at_updates(grouped, seen, config):
    """--align updates: exchanges 2 (both alternatives) and 3 (the deals), split_updates.py.
    Returns the grid's bytes and each node's (plan, extras)."""
    nodes = range(config.world.num_nodes)
    drafts, totals = [], []
    for node in nodes:
        draft, payload = split_updates.node_totals(node, grouped[node], seen[node].decision, config)
        drafts.append(draft)
        totals.append(payload)
    summed = split_updates.hub_combine(totals, seen[0].decision.num_steps)
    parts = [
        split_updates.node_complete(drafts[n], seen[n].decision, summed, config) for n in nodes
    ]
    firsts = [config.world.ranks_of(n).start for n in nodes]
    dealt = [split_updates.node_deals(parts[n], firsts[n], config) for n in nodes]
    grid = split_updates.hub_grid([p for _, p in dealt], [p.windows for p, _ in parts[0]])
    done = [split_updates.node_align(parts[n], dealt[n][0], grid, firsts[n], config) for n in nodes]
    return grid, done


def assert_same_extras(a, b) -> None:
    assert (a.offered_samples, a.offered_tokens, a.splits) == (
        b.offered_samples, b.offered_tokens, b.splits
    )  # fmt: skip
    assert a.step_max_work.tobytes() == b.step_max_work.tobytes()
    assert a.step_sum_work.tobytes() == b.step_sum_work.tobytes()


@SPLIT_SETTINGS
@given(rounds())
def test_the_hubs_decision_gives_every_node_its_part_of_the_whole_world_plan(case):
    config, offers, round_index = case
    whole = plan_round(offers, config, round_index)
    got = []
    _, _, seen, parts = live_round(offers, config, round_index, extras_out=got)
    for payload in seen:
        assert payload.decision is not None
        assert payload.facts.invariant is None and payload.facts.schema is None
    assert_same_plan(assemble(parts, seen[0].decision), whole)
    # the round-wide facts the daemons read from every offer before, now from the hub
    extras = got[0]
    assert extras.splits == sum(u.num_splits for u in whole.units)
    recirculated = extras.offered_samples - int(whole.stats.global_num_samples.sum())
    assert recirculated == sum(len(u.leftover) for u in whole.units)
    tables = [t for u in whole.units for t in (u.emitted, u.leftover)]
    assert extras.offered_samples == sum(len(t) for t in tables)
    assert extras.offered_tokens == sum(int(t.tokens.sum()) for t in tables)
    work = whole.stats.work
    assert np.array_equal(extras.step_max_work, work.max(axis=1))
    assert np.allclose(extras.step_sum_work, work.sum(axis=1), rtol=1e-12)


@st.composite
def update_rounds(draw):
    """rounds() with --align updates: updates of K steps or T tokens (a case without them gets
    --accumulate 2; --align updates refuses a world where every step is an update)."""
    config, offers, round_index = draw(rounds())
    if not config.windows:
        config = dataclasses.replace(config, accumulate=draw(st.integers(2, 4)))
    return dataclasses.replace(config, align=Align.UPDATES), offers, round_index


@SPLIT_SETTINGS
@given(update_rounds())
def test_under_align_updates_every_node_gets_its_part_of_the_whole_world_plan(case):
    """Issue 26 on the split planner: the third exchange (each node's deals -> the hub's step
    grid) gives every node exactly its part of plan_round's aligned plan, and the per-step
    round facts (samples, tokens, costs) on the new grid."""
    config, offers, round_index = case
    whole = plan_round(offers, config, round_index)
    got = []
    _, _, seen, parts = live_round(offers, config, round_index, extras_out=got)
    assert seen[0].decision is not None
    plan = assemble(parts, seen[0].decision)
    assert_same_plan(plan, whole)
    assert whole.micro_steps is not None and plan.micro_steps is not None
    assert np.array_equal(plan.micro_steps, whole.micro_steps)
    for p in parts:  # every node holds the world's per-step facts of the aligned grid
        assert np.array_equal(p.global_num_samples, whole.stats.num_samples.sum(axis=1))
        assert np.array_equal(p.global_num_tokens, whole.stats.num_tokens.sum(axis=1))
    extras = got[0]
    assert extras.splits == sum(u.num_splits for u in whole.units)
    assert np.array_equal(extras.step_max_work, whole.stats.work.max(axis=1))
    assert np.allclose(extras.step_sum_work, whole.stats.work.sum(axis=1), rtol=1e-12)


@SPLIT_SETTINGS
@given(rounds())
def test_the_decision_survives_its_bytes(case):
    config, offers, round_index = case
    _, _, seen, _ = live_round(offers, config, round_index)
    again = split_round.decode_decision(split_round.encode_decision(seen[0], round_index), config)
    assert_same_decision(again.decision, seen[0].decision)


def offers_of(config, per_unit: int) -> list[UnitOffer]:
    rng = np.random.default_rng(0)
    offers, first = [], 0
    for unit in range(config.num_units):
        lengths = rng.integers(1, 2000, per_unit)
        table = SampleTable.of(np.arange(first, first + per_unit), lengths, lengths // 2)
        offers.append(UnitOffer(unit, table, False))
        first += per_unit
    return offers


@pytest.mark.parametrize("buffer", [64, 1024])
def test_what_a_node_receives_does_not_grow_with_the_nodes_or_the_buffer(buffer):
    """Issue 25: the decision is bounded whatever the node count (a header, the facts, and
    company.py's cap profile of at most PROFILE_DEPTH floats); the totals are 40 bytes a step
    plus 44 (and 16 per repeated identity emitted: fewer than W in an epoch, none here)."""
    sizes = {}
    for nodes in (2, 8, 32):
        config = make_config(world=nodes, per_node=1, budget=4096, buffer=buffer)
        decided, summed, seen, parts = live_round(offers_of(config, buffer), config, 3)
        steps = seen[0].decision.num_steps
        assert len(summed) == 16 + 28 + 40 * steps
        sizes[nodes] = len(decided)
        assert len(decided) + len(summed) <= 16 * 1024, (nodes, len(decided), len(summed))
    assert max(sizes.values()) <= 200 + 8 * company.PROFILE_DEPTH, sizes


def test_nodes_on_different_epochs_or_resume_points_fail_the_round_everywhere():
    config = make_config(world=2, per_node=1, budget=4096, buffer=8)
    offers = offers_of(config, 8)
    _, _, seen, parts = live_round(
        offers, config, 0, side=lambda node: {"resume": (1, 5) if node else None}
    )
    assert parts == [] and all(p.decision is None for p in seen)
    assert "node 0" in seen[0].facts.invariant and "resume" in seen[0].facts.invariant
    summaries = [
        split_round.node_summary(summary_codec.NodeSummary(n, n, ()), [offers[n]], config, 0)[1]
        for n in range(2)
    ]
    decided = split_round.decode_decision(split_round.hub_decide(summaries, config, 0), config)
    assert decided.facts.invariant == "nodes disagree on the epoch being planned: [0, 1]"


def test_side_facts_are_merged_in_node_order():
    config = make_config(world=3, per_node=1, budget=4096, buffer=8)
    side = {
        0: {"rejected": {"zero_length": 2}, "ended": ((0, 1, 4),)},
        1: {"rejected": {"zero_length": 1, "schema_mismatch": 3}, "schema": (7, "a")},
        2: {"ended": ((2, 1, 3),), "schema": (7, "a")},
    }
    _, _, seen, parts = live_round(offers_of(config, 8), config, 0, side=lambda n: side[n])
    facts = seen[0].facts
    assert facts.rejected == {"zero_length": 3, "schema_mismatch": 3}
    assert facts.ended == ((0, 1, 4), (2, 1, 3))
    assert facts.schema is None and len(parts) == 3
    side[2]["schema"] = (8, "b")
    _, _, seen, _ = live_round(offers_of(config, 8), config, 0, side=lambda n: side[n])
    assert "node 1: a; node 2: b" in seen[0].facts.schema


def test_a_summary_in_the_wrong_place_or_a_short_result_is_refused():
    config = make_config(world=2, per_node=1, budget=4096, buffer=8)
    offers = offers_of(config, 8)
    payloads = [
        split_round.node_summary(summary_codec.NodeSummary(n, 0, ()), [offers[n]], config, 0)[1]
        for n in range(2)
    ]
    with pytest.raises(payload_checks.BadPayloadError, match="node 0 sent .* calls itself node 1"):
        split_round.hub_decide(payloads[::-1], config, 0)
    with pytest.raises(InvariantError, match="node 1 sent a round 0 payload that is not an odbd"):
        split_round.hub_decide([payloads[0], payloads[1][:-3]], config, 0)
    extras = split_round.RoundExtras(1, 2, 3, np.ones(3), np.ones(3))
    totals = split_round.encode_round_totals(
        RoundTotals(np.ones(3, np.int64), np.ones(3, np.int64), np.zeros(0), False), extras
    )
    assert split_round.decode_round_totals(totals, 3)[1].splits == 3
    with pytest.raises(InvariantError, match="hold 3 steps, the round has 4"):
        split_round.decode_round_totals(totals, 4)
    with pytest.raises(InvariantError, match="trailing"):
        split_round.decode_round_totals(totals + b"x", 3)


def test_the_hubs_cost_fit_reaches_every_node_bit_for_bit():
    from odbd.daemon.cost_learning import CostLearner
    from odbd.planner.config import CostModel
    from odbd.planner.cost_fit import CostModelMode, FitConfig, FitState

    config = make_config(world=2, per_node=1, budget=4096, buffer=8)
    learner = CostLearner(CostModelMode.AUTO, CostModel(), FitConfig())
    rng = np.random.default_rng(1)
    padded = rng.integers(100, 4000, (200, 1)).astype(float)
    sum_sq = padded * rng.uniform(50, 500, (200, 1))
    seconds = 1e-4 * padded + 3e-8 * sum_sq + 0.01
    rows = np.hstack([padded, sum_sq, seconds])
    offers = offers_of(config, 8)
    payloads = [
        split_round.node_summary(
            summary_codec.NodeSummary(n, 0, (), observations=rows[n * 64 : (n + 1) * 64]),
            [offers[n]],
            config,
            0,
        )[1]
        for n in range(2)
    ]
    decided = split_round.hub_decide(payloads, config, 0, absorb=learner.absorb)
    fit = split_round.decode_decision(decided, config).facts.fit
    assert fit is not None and fit.state is FitState.FITTED
    assert fit == learner.fit  # floats through JSON: exact
    assert fit.num_observations == 128


@pytest.mark.parametrize(
    ("unit", "side", "needle"),
    [
        ((1, False, 4, 5, 10, np.zeros(0)), {}, "5 groups of 4 samples"),
        ((1, False, 4, 2, 2**31, np.zeros(0)), {}, "longest sample, 2147483648"),
        ((1, False, 4, 2, 10, np.array([1.0, -2.0])), {}, "negative or non-finite"),
        ((1, False, 4, 2, 10, np.array([np.nan])), {}, "negative or non-finite"),
        ((0, False, 4, 2, 10, np.zeros(0)), {}, "summarizes units [0], but its units are [1]"),
        ((1, False, 4, 2, 10, np.zeros(0)), {"ended": ((9, 0, 1),)}, "names no rank"),
        ((1, False, 4, 2, 10, np.zeros(0)), {"rejected": {"made_up": 1}}, "not one odbd knows"),
    ],
)
def test_a_summary_out_of_range_fails_naming_the_node_and_the_field(unit, side, needle):
    from odbd.planner.types import UnitSummary

    config = make_config(world=2, per_node=1, budget=4096, buffer=8)
    offers = offers_of(config, 8)
    good = split_round.node_summary(summary_codec.NodeSummary(0, 0, ()), [offers[0]], config, 0)[1]
    summary = summary_codec.NodeSummary(1, 0, (UnitSummary(*unit),), **side)
    bad = summary_codec.encode_summary(summary)
    with pytest.raises(payload_checks.BadPayloadError, match="node 1 sent a round 5 summary") as e:
        split_round.hub_decide([good, bad], config, 1_000_000_005, label=5)
    assert needle in str(e.value)
