"""The split planner: each node plans its own units from its own offers and the round's two small
payloads (summaries, step totals), and the parts put side by side are exactly plan_round's plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odbd.daemon import summary_codec
from odbd.errors import InvariantError
from odbd.planner import company
from odbd.planner.completion import combine, complete_node
from odbd.planner.config import Balance, Collate, CostModel, Grouping, LossScaling, PlannerConfig
from odbd.planner.decision import decide_round
from odbd.planner.node_plan import plan_node
from odbd.planner.round import assemble, plan_round, units_of_node
from odbd.planner.summary import group_unit, summarize
from odbd.planner.types import (
    RoundDecision,
    RoundPlan,
    SampleTable,
    StepTotals,
    UnitOffer,
    UnitSummary,
)
from tests.unit.planner_factories import make_config

SPLIT_SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def rounds(draw):
    """A config and one round's offers: random lengths (some over the budget), ages, dry flags,
    vision patches; padded or packed batches, with or without a patch budget (issue 13)."""
    per_node = draw(st.integers(1, 4))
    nodes = draw(st.integers(1, 5))
    budget = draw(st.integers(50, 2000))
    windows = draw(st.sampled_from(["none", "accumulate", "tokens"]))
    grouping = draw(st.sampled_from(list(Grouping)))
    # Packed groups and a patch budget are min-time only (the paper's grouping is padded).
    collate = Collate.PADDED if grouping is Grouping.PAPER else draw(st.sampled_from(list(Collate)))
    max_patches = 0 if grouping is Grouping.PAPER else draw(st.sampled_from([0, 1, 7, 64]))
    config = make_config(
        world=nodes * per_node,
        per_node=per_node,
        budget=budget,
        buffer=draw(st.integers(1, 12)),
        grouping=grouping,
        balance=draw(st.sampled_from(list(Balance))),
        loss_scaling=draw(st.sampled_from(list(LossScaling))),
        seed=draw(st.integers(0, 3)),
        accumulate=draw(st.integers(2, 4)) if windows == "accumulate" else 1,
        tokens_per_update=draw(st.integers(1, 4 * budget)) if windows == "tokens" else 0,
        collate=collate,
        max_patches=max_patches,
    )
    config = dataclasses.replace(config, cost=CostModel(p=draw(st.sampled_from([0.0, 1.0, 10.0]))))
    offers, first = [], 0
    for unit in range(config.num_units):
        n = draw(st.integers(0, config.unit_capacity))
        long_or_short = st.one_of(st.integers(1, 3 * budget), st.integers(1, max(budget // 6, 1)))
        lengths = draw(st.lists(long_or_short, min_size=n, max_size=n))
        tokens = [draw(st.integers(0, x)) for x in lengths]
        ages = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
        patches = draw(st.lists(st.sampled_from([0, 0, 1, 3, 16, 80]), min_size=n, max_size=n))
        table = SampleTable.of(np.arange(first, first + n), lengths, tokens, ages, patches)
        offers.append(UnitOffer(unit, table, draw(st.booleans())))
        first += n
    return config, offers, draw(st.integers(0, 50))


def node_round(
    node: int,
    own: list[UnitOffer],
    summary_payloads: list[bytes] | None,
    totals_payloads: list[bytes] | None,
    config: PlannerConfig,
    round_index: int,
):
    """What one daemon computes, seeing only its own offers and the exchanged bytes."""
    grouped = [group_unit(o, config, round_index) for o in own]
    mine = summary_codec.NodeSummary(
        node, 0, tuple(summarize(u, config.num_units) for u in grouped)
    )
    if summary_payloads is None:
        return summary_codec.encode_summary(mine), None, None
    summaries = [u for p in summary_payloads for u in summary_codec.decode_summary(p).units]
    decision = decide_round(summaries, config, round_index)
    draft = plan_node(node, grouped, decision, config)
    if totals_payloads is None:
        return summary_codec.encode_totals(draft.totals), decision, None
    totals = combine([summary_codec.decode_totals(p) for p in totals_payloads], decision.num_steps)
    return None, decision, complete_node(draft, decision, totals, config)


def split_round(offers: list[UnitOffer], config: PlannerConfig, round_index: int):
    """Runs every node through both exchanges; returns (per-node decisions, per-node parts)."""
    nodes = range(config.world.num_nodes)
    own = [[offers[u] for u in units_of_node(config, n)] for n in nodes]
    summaries = [node_round(n, own[n], None, None, config, round_index)[0] for n in nodes]
    totals = [node_round(n, own[n], summaries, None, config, round_index)[0] for n in nodes]
    done = [node_round(n, own[n], summaries, totals, config, round_index) for n in nodes]
    return [d[1] for d in done], [d[2] for d in done]


def assert_same_plan(a: RoundPlan, b: RoundPlan) -> None:
    assert (a.round_index, a.num_steps, a.final) == (b.round_index, b.num_steps, b.final)
    for ua, ub in zip(a.units, b.units, strict=True):
        assert ua.unit == ub.unit and ua.num_splits == ub.num_splits
        assert np.array_equal(ua.slot_offsets, ub.slot_offsets)
        for table in ("emitted", "leftover"):
            for col in ("views", "lengths", "tokens", "ages", "patches"):
                x, y = getattr(getattr(ua, table), col), getattr(getattr(ub, table), col)
                assert np.array_equal(x, y)
    for f in dataclasses.fields(a.stats):
        assert np.array_equal(getattr(a.stats, f.name), getattr(b.stats, f.name)), f.name
    for f in dataclasses.fields(a.windows):
        assert np.array_equal(getattr(a.windows, f.name), getattr(b.windows, f.name)), f.name


def assert_same_decision(a: RoundDecision, b: RoundDecision) -> None:
    assert (a.round_index, a.num_steps, a.all_dry) == (b.round_index, b.num_steps, b.all_dry)
    assert np.array_equal(a.step_order, b.step_order)
    assert (a.reference is None) == (b.reference is None)
    if a.reference is not None and b.reference is not None:
        assert a.reference.tobytes() == b.reference.tobytes()  # bit for bit


@SPLIT_SETTINGS
@given(rounds())
def test_node_parts_assemble_into_the_whole_world_plan(case):
    config, offers, round_index = case
    decisions, parts = split_round(offers, config, round_index)
    for d in decisions[1:]:  # shared decisions: identical on every daemon
        assert_same_decision(decisions[0], d)
    for p in parts[1:]:  # shared round facts: identical on every daemon
        assert (p.num_steps, p.final) == (parts[0].num_steps, parts[0].final)
        assert np.array_equal(p.global_num_tokens, parts[0].global_num_tokens)
        assert np.array_equal(p.global_num_samples, parts[0].global_num_samples)
        assert np.array_equal(p.windows.ends, parts[0].windows.ends)
    whole = plan_round(offers, config, round_index)
    assert_same_plan(assemble(parts, decisions[0]), whole)
    # The global totals each node received are what the whole plan's ranks sum to.
    assert np.array_equal(parts[0].global_num_tokens, whole.stats.global_num_tokens)
    if config.collate is Collate.PACKED:  # padding-free: the padded tokens are the real ones
        assert np.array_equal(whole.stats.padded_tokens, whole.stats.real_tokens)


@SPLIT_SETTINGS
@given(rounds())
def test_each_node_plans_exactly_its_own_ranks_and_samples(case):
    config, offers, round_index = case
    _, parts = split_round(offers, config, round_index)
    g = config.ranks_per_unit
    for node, part in enumerate(parts):
        assert [u.unit for u in part.units] == list(units_of_node(config, node))
        assert part.stats.num_samples.shape == (part.num_steps, config.world.ranks_per_node)
        for unit in part.units:
            assert len(unit.slot_offsets) == part.num_steps * g + 1  # every rank: T steps
            offered = offers[unit.unit].samples.views
            planned = np.concatenate([unit.emitted.views, unit.leftover.views])
            assert sorted(planned.tolist()) == sorted(offered.tolist())  # no loss, no dupes
            assert_groups_within_budgets(unit, config)


def assert_groups_within_budgets(unit, config: PlannerConfig) -> None:
    """DESIGN 3.5 on a node's own groups: padded area (packed: sum of lengths) <= L and, with
    --max-patches, patches <= N, unless the group is a single sample."""
    packed = config.collate is Collate.PACKED
    for start, end in zip(unit.slot_offsets[:-1], unit.slot_offsets[1:], strict=True):
        lengths = unit.emitted.lengths[start:end]
        if len(lengths) > 1:
            area = int(lengths.sum()) if packed else int(lengths.max()) * len(lengths)
            assert area <= config.token_budget
            if config.max_patches:
                assert int(unit.emitted.patches[start:end].sum()) <= config.max_patches


@SPLIT_SETTINGS
@given(rounds())
def test_exact_loss_scales_of_the_split_plan_are_per_token_over_the_world(case):
    config, offers, round_index = case
    config = dataclasses.replace(config, loss_scaling=LossScaling.EXACT)
    _, parts = split_round(offers, config, round_index)
    world = config.world.world_size
    windows = parts[0].windows
    tokens = np.concatenate([p.stats.num_tokens for p in parts], axis=1).astype(np.float64)
    scales = np.concatenate([p.stats.loss_scale for p in parts], axis=1)
    mean_loss = np.random.default_rng(round_index).random(tokens.shape)  # per (step, rank)
    # DESIGN 3.4 per update: sum over micro-steps of DDP's mean over ranks of scale * mean loss
    # equals the update's per-token mean loss (token-sum of losses / the update's tokens).
    ddp = np.bincount(windows.of_step(), (scales * mean_loss).sum(axis=1) / world, len(windows))
    token_sum = np.bincount(windows.of_step(), (tokens * mean_loss).sum(axis=1), len(windows))
    has_tokens = windows.num_tokens > 0
    per_token = token_sum[has_tokens] / windows.num_tokens[has_tokens]
    assert np.allclose(ddp[has_tokens], per_token, rtol=1e-9)


def test_summary_payload_does_not_grow_with_the_buffer():
    config = make_config(world=8, per_node=8, budget=12288, buffer=1024)
    lengths = np.random.default_rng(0).integers(16, 12288, 8192)
    ordinary = UnitOffer(0, SampleTable.of(np.arange(8192), lengths), False)
    assert len(summarize(group_unit(ordinary, config, 0), 1).profile) == 0  # no giant, no profile
    # ... unless enough units cap every round (company.caps_every_round): 4 nodes of 8
    every_round = make_config(world=32, per_node=8, budget=12288, buffer=1024)
    assert len(summarize(group_unit(ordinary, every_round, 0), 4).profile) == company.PROFILE_DEPTH
    lengths[0] = 20_000  # one sample over the budget: the cost profile rides along
    offer = UnitOffer(0, SampleTable.of(np.arange(8192), lengths), False)
    summary = summarize(group_unit(offer, config, 0), 1)
    assert len(summary.profile) == company.PROFILE_DEPTH
    payload = summary_codec.encode_summary(summary_codec.NodeSummary(0, 0, (summary,)))
    # company.PROFILE_DEPTH float64s (8 KiB) and a header, whatever the buffer size, vs 24
    # bytes per sample (192 KiB here) in the offer payload
    assert len(payload) < 8 * company.PROFILE_DEPTH + 128
    decoded = summary_codec.decode_summary(payload).units[0]
    assert decoded.profile.tobytes() == summary.profile.tobytes()
    assert dataclasses.replace(decoded, profile=summary.profile) == summary


def test_totals_payload_round_trips_bit_for_bit():
    config = make_config(world=4, per_node=2, loss_scaling=LossScaling.APPROX)
    offers = [UnitOffer(u, SampleTable.of(np.arange(8) + 8 * u, [100 + u] * 8), False)
              for u in range(2)]  # fmt: skip
    grouped = [group_unit(offers[0], config, 0)]
    decision = decide_round(
        [summarize(group_unit(o, config, 0), config.num_units) for o in offers], config, 0
    )
    totals = plan_node(0, grouped, decision, config).totals
    back = summary_codec.decode_totals(summary_codec.encode_totals(totals))
    assert back.node == 0 and back.drained == totals.drained
    assert back.approx_weights.tobytes() == totals.approx_weights.tobytes()
    assert np.array_equal(back.num_tokens, totals.num_tokens)
    assert np.array_equal(back.num_samples, totals.num_samples)


def test_a_payload_of_another_kind_is_refused():
    summary = summary_codec.encode_summary(summary_codec.NodeSummary(0, 0, ()))
    with pytest.raises(InvariantError, match="kind 1, expected"):
        summary_codec.decode_totals(summary)


def test_totals_wider_than_int32_travel_as_int64():
    wide = StepTotals(3, np.array([2**40, 5]), np.array([1, 2]), np.zeros(0), True)
    narrow = StepTotals(3, np.array([2**20, 5]), np.array([1, 2]), np.zeros(0), False)
    for totals in (wide, narrow):
        back = summary_codec.decode_totals(summary_codec.encode_totals(totals))
        assert np.array_equal(back.num_tokens, totals.num_tokens)
        assert (back.node, back.drained) == (totals.node, totals.drained)
    assert len(summary_codec.encode_totals(narrow)) < len(summary_codec.encode_totals(wide))


def test_summary_side_facts_round_trip():
    unit = UnitSummary(7, True, 12, 3, 40_000, np.array([3.5, 2.25, 1.0]))
    observations = np.array([[1200.0, 3.0e6, 0.125], [800.0, 1.0e6, 0.0625]])
    summary = summary_codec.NodeSummary(2, 5, (unit,), {"too_long": 3}, (4, 17), observations)
    back = summary_codec.decode_summary(summary_codec.encode_summary(summary))
    assert (back.node, back.epoch, back.rejected, back.resume) == (2, 5, {"too_long": 3}, (4, 17))
    assert back.observations.tobytes() == observations.tobytes()
    assert back.units[0].profile.tobytes() == unit.profile.tobytes()
    assert dataclasses.replace(back.units[0], profile=unit.profile) == unit
