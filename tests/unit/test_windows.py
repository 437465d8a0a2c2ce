"""Optimizer updates (issue 12): windows of steps, exact loss scales over each update, and
DESIGN.md section 3's guarantees with windows on (hypothesis)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.errors import ConfigError
from odbd.planner.config import LossScaling
from odbd.planner.epoch import simulate
from odbd.planner.ledger import ViewState
from odbd.planner.round import plan_round
from odbd.planner.sampler import num_views
from odbd.planner.windows import cut_windows, pack_order, round_step_count
from tests.unit.planner_factories import make_config, make_offers
from tests.unit.test_planner_properties import (
    PROPERTY_SETTINGS,
    check_budget_and_scaling,
    groups_of,
    scenarios,
)


def test_accumulate_cuts_k_steps_and_leaves_the_tail_open():
    w = cut_windows(np.array([5, 5, 5, 5, 5]), np.ones(5, dtype=np.int64), 2, 0)
    assert w.starts.tolist() == [0, 2, 4] and w.ends.tolist() == [2, 4, 5]
    assert w.closed.tolist() == [True, True, False]
    assert w.num_tokens.tolist() == [10, 10, 5] and w.num_samples.tolist() == [2, 2, 1]
    assert w.of_step().tolist() == [0, 0, 1, 1, 2]
    assert w.step_is_end(5).tolist() == [False, True, False, True, True]


def test_tokens_per_update_closes_at_the_first_step_reaching_t():
    w = cut_windows(np.array([4, 3, 9, 1, 1, 1]), np.ones(6, dtype=np.int64), 1, 7)
    assert w.ends.tolist() == [2, 3, 6] and w.closed.tolist() == [True, True, False]
    assert w.num_tokens.tolist() == [7, 9, 3]


def test_pack_order_closes_each_update_with_the_best_fitting_step():
    tokens = np.array([5, 5, 9, 3, 5, 1], dtype=np.int64)
    order = pack_order(tokens, 8)
    # 5 first (the shuffled order); the next 5 would close at 10: the 3 closes at 8 instead.
    assert order.tolist()[:2] == [0, 3]
    assert sorted(order.tolist()) == list(range(6))
    w = cut_windows(tokens[order], np.ones(6, dtype=np.int64), 1, 8)
    assert w.num_tokens[w.closed].tolist()[0] == 8


@given(st.lists(st.integers(0, 50), max_size=60), st.integers(1, 200))
def test_pack_order_is_a_permutation_that_never_overshoots_more(tokens, target):
    tokens = np.asarray(tokens, dtype=np.int64)
    order = pack_order(tokens, target)
    assert sorted(order.tolist()) == list(range(len(tokens)))
    packed = cut_windows(tokens[order], np.ones(len(tokens), dtype=np.int64), 1, target)
    plain = cut_windows(tokens, np.ones(len(tokens), dtype=np.int64), 1, target)
    if packed.closed.any() and plain.closed.any():
        assert packed.num_tokens[0] <= plain.num_tokens[0]


def test_round_step_count_is_a_multiple_of_k_unless_flushing():
    assert round_step_count(7, 3, flushing=False) == 6
    assert round_step_count(2, 3, flushing=False) == 3
    assert round_step_count(7, 3, flushing=True) == 7
    assert round_step_count(7, 1, flushing=False) == 7


def test_without_windows_every_step_is_an_update_with_todays_scales():
    config = make_config(world=4, per_node=2, budget=1000, buffer=8)
    offers = make_offers(config, [[300, 200, 120, 80] * 4, [120, 700, 50] * 5])
    plan = plan_round(offers, config, 0)
    assert plan.windows.ends.tolist() == list(range(1, plan.num_steps + 1))
    assert plan.windows.num_tokens.tolist() == plan.stats.global_num_tokens.tolist()


def test_accumulate_scales_every_update_to_its_per_token_mean():
    config = make_config(world=4, per_node=2, budget=1000, buffer=8, accumulate=2)
    offers = make_offers(config, [[300, 200, 120, 80] * 4, [120, 700, 50] * 5])
    plan = plan_round(offers, config, 0)
    assert plan.num_steps % 2 == 0 and (plan.windows.ends - plan.windows.starts == 2).all()
    check_update_scales(plan, LossScaling.EXACT)


def test_an_unclosed_tail_recirculates_mid_epoch():
    config = make_config(world=2, per_node=2, budget=1000, buffer=8, tokens_per_update=2500)
    offers = make_offers(config, [[500] * 16])
    plan = plan_round(offers, config, 0)
    assert plan.windows.closed.all() and len(plan.windows) >= 1
    emitted = len(plan.units[0].emitted)
    assert emitted + len(plan.units[0].leftover) == 16
    assert plan.num_steps == int(plan.windows.ends[-1])


def test_accumulate_and_tokens_per_update_are_exclusive():
    with pytest.raises(ConfigError, match="pass one of them"):
        make_config(accumulate=2, tokens_per_update=100)


def test_windows_refuse_no_join():
    config = make_config(accumulate=2)
    with pytest.raises(ConfigError, match="need join mode"):
        simulate(np.array([5, 6, 7]), config, join=False)


def check_update_scales(plan, mode):
    """Exact: each rank-step's loss_scale / W is its share t_sr / T_update of the update."""
    stats, windows = plan.stats, plan.windows
    world = stats.num_samples.shape[1]
    window_of_step = windows.of_step()
    totals = windows.num_tokens[window_of_step]
    assert windows.num_tokens.sum() == stats.num_tokens.sum()
    if mode is LossScaling.EXACT:
        has = totals > 0
        share = stats.num_tokens[has] / totals[has][:, None]
        assert np.allclose(stats.loss_scale[has] / world, share, rtol=1e-12, atol=0)
    assert (stats.loss_scale[stats.num_samples == 0] == 0).all()


@st.composite
def windowed(draw):
    config, lengths, tokens, arrivals, _, patches = draw(scenarios())[:6]
    if draw(st.booleans()):
        extra = {"accumulate": draw(st.integers(2, 5))}
    else:
        extra = {"tokens_per_update": draw(st.integers(1, 4 * config.token_budget))}
    return dataclasses.replace(config, **extra), lengths, tokens, arrivals, patches


@PROPERTY_SETTINGS
@given(windowed(), st.integers(1, 2))
def test_windowed_join_mode_properties(scenario, epochs):
    config, lengths, tokens, arrivals, patches = scenario
    result = simulate(
        lengths, config, epochs=epochs, join=True, tokens=tokens, arrivals_per_round=arrivals,
        patches=patches,
    )  # fmt: skip
    world = config.world.world_size
    # Identity coverage: every epoch emits every view exactly once (or rejects it).
    m = num_views(len(lengths), world)
    for epoch, ledger in enumerate(result.ledgers):
        ledger.check()
        counts = ledger.counts()
        assert counts[ViewState.EMITTED] + counts[ViewState.REJECTED] == m
        emitted = [v for e, _, views, _ in groups_of(result) if e == epoch for v in views]
        assert len(emitted) == len(set(emitted)) == counts[ViewState.EMITTED]
    for plan in result.rounds:
        w = plan.windows
        # Windows tile the round: every rank runs the same micro-steps in every update.
        assert w.ends[-1:].tolist() == ([plan.num_steps] if plan.num_steps else [])
        assert (w.ends > w.starts).all() and (w.starts[1:] == w.ends[:-1]).all()
        for unit in plan.units:
            assert len(unit.slot_offsets) == plan.num_steps * config.ranks_per_unit + 1
        # Window totals are the sums of their steps.
        steps = w.of_step()
        assert np.array_equal(
            np.bincount(steps, plan.stats.global_num_tokens, len(w)).astype(np.int64),
            w.num_tokens,
        )
        assert w.num_samples.sum() == plan.stats.num_samples.sum()
        # Only the epoch's last update, or a round too small to close one, is short.
        open_ = np.flatnonzero(~w.closed)
        assert open_.size <= 1
        if open_.size:
            assert open_[0] == len(w) - 1 and (plan.final or len(w) == 1)
        sizes = w.ends - w.starts
        if config.accumulate > 1:
            assert (sizes[w.closed] == config.accumulate).all()
        else:
            assert (w.num_tokens[w.closed] >= config.tokens_per_update).all()
            last_step = plan.stats.global_num_tokens[w.ends - 1]
            assert (w.num_tokens[w.closed] - last_step[w.closed] < config.tokens_per_update).all()
        check_update_scales(plan, config.loss_scaling)
    check_budget_and_scaling_of_updates(result, config, patches)


def check_budget_and_scaling_of_updates(result, config, patches):
    """The budget holds as without windows; scales are per update, so the per-step scaling
    check applies only to the budget part (loss_scale 0 on idle fillers still holds)."""
    if config.loss_scaling is not LossScaling.EXACT:
        check_budget_and_scaling(result, config, patches)
        return
    exact_per_step = dataclasses.replace(config, loss_scaling=LossScaling.NONE)
    check_budget_and_scaling(result, exact_per_step, patches)


@settings(max_examples=25, deadline=None)
@given(windowed())
def test_windowed_plans_are_the_same_for_the_same_inputs(scenario):
    # DESIGN 3.6 with windows: every daemon computes the same updates and scales.
    config, lengths, tokens, arrivals, patches = scenario
    a = simulate(lengths, config, tokens=tokens, arrivals_per_round=arrivals, patches=patches)
    b = simulate(lengths, config, tokens=tokens, arrivals_per_round=arrivals, patches=patches)
    assert a.steps_kept == b.steps_kept
    for pa, pb in zip(a.rounds, b.rounds, strict=True):
        assert np.array_equal(pa.windows.ends, pb.windows.ends)
        assert np.array_equal(pa.stats.loss_scale, pb.stats.loss_scale)
        for ua, ub in zip(pa.units, pb.units, strict=True):
            assert np.array_equal(ua.emitted.views, ub.emitted.views)
            assert np.array_equal(ua.slot_offsets, ub.slot_offsets)
