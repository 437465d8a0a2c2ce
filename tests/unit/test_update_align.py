"""--align updates (planner/update_align.py, issue 26): DESIGN.md section 3's properties for
ranks aligned at optimizer updates, as hypothesis properties, and the daemon's per-rank
Update messages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odbd.daemon.updates import UpdateNumbering
from odbd.errors import ConfigError
from odbd.metrics.stats import DaemonStats
from odbd.planner.config import Align, Collate, LossScaling
from odbd.planner.ledger import ViewState
from odbd.planner.round import plan_round
from odbd.planner.sampler import num_views
from odbd.planner.update_align import rank_runs, update_times
from odbd.simulate.update_align import compare_align
from tests.unit.planner_factories import make_config, make_offers
from tests.unit.test_planner_properties import groups_of, scenarios

PROPERTY_SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def update_scenarios(draw):
    """test_planner_properties' worlds and datasets, with updates of K steps or T tokens."""
    scenario = draw(scenarios())
    if draw(st.booleans()):
        windows = {"accumulate": draw(st.integers(2, 5)), "tokens_per_update": 0}
    else:
        windows = {"accumulate": 1, "tokens_per_update": draw(st.integers(1, 20_000))}
    config = dataclasses.replace(scenario.config, align=Align.UPDATES, **windows)
    return scenario._replace(config=config)


def _window_slots(plan, unit, g, start, end):
    """Sorted views of each slot's group of one unit over steps [start, end)."""
    out = []
    for step in range(start, end):
        for local in range(g):
            views = unit.emitted.views[unit.slot(step, local, g)]
            if views.size:
                out.append(tuple(sorted(views.tolist())))
    return sorted(out)


@PROPERTY_SETTINGS
@given(update_scenarios(), st.integers(1, 2))
def test_update_alignment_properties(scenario, epochs):
    config, lengths = scenario.config, scenario.lengths
    result = scenario.run(epochs=epochs, join=True)
    world = config.world.world_size
    for plan in result.rounds:
        assert plan.micro_steps is not None
        windows = plan.windows
        # 1'. Update alignment: updates tile the round, every rank runs every update, at
        # least one micro-step of it (a filler when it has no group) and at most its steps;
        # a rank's groups fill its first slots of the update, and every slot it skips is idle.
        assert windows.starts[0] == 0 if len(windows) else plan.num_steps == 0
        assert np.array_equal(windows.starts[1:], windows.ends[:-1])
        assert (windows.ends[-1] if len(windows) else 0) == plan.num_steps
        assert plan.micro_steps.shape == (len(windows), world)
        sizes = (windows.ends - windows.starts)[:, None]
        assert (plan.micro_steps >= 1).all() and (plan.micro_steps <= sizes).all()
        # the update spans as many steps as its busiest rank runs micro-steps (or was planned)
        runs = rank_runs(plan)
        busy = plan.stats.num_samples > 0
        assert not (busy & ~runs).any()
        for w in range(len(windows)):
            start, end = int(windows.starts[w]), int(windows.ends[w])
            mine = busy[start:end].sum(axis=0)
            assert (mine == np.where(mine > 0, plan.micro_steps[w], 0)).all()
            for r in np.flatnonzero(mine):
                assert busy[start : start + int(plan.micro_steps[w, r]), r].all()
        # The update's totals (what exact loss scales divide by) are its slots' sums.
        assert np.array_equal(
            windows.num_tokens,
            np.add.reduceat(plan.stats.num_tokens.sum(axis=1), windows.starts)
            if len(windows) else np.zeros(0, np.int64),
        )  # fmt: skip

    # 2. Every view of each epoch emitted or rejected, once.
    m = num_views(len(lengths), world)
    for epoch, ledger in enumerate(result.ledgers):
        ledger.check()
        counts = ledger.counts()
        assert counts[ViewState.EMITTED] + counts[ViewState.REJECTED] == m
        emitted = [v for e, _, views, _ in groups_of(result) if e == epoch for v in views]
        assert len(emitted) == len(set(emitted)) == counts[ViewState.EMITTED]

    # 4'. Exact loss scaling per update: a slot's scale / W is its tokens over the update's,
    # whichever rank and micro-step the slot moved to, so summed over every rank's micro-steps
    # (what DDP averages at the update's end) the gradient is the per-token mean of the update.
    if config.loss_scaling is LossScaling.EXACT:
        for plan in result.rounds:
            total = plan.windows.num_tokens[plan.windows.of_step()][:, None]
            scale = plan.stats.loss_scale / world
            has = np.broadcast_to(total > 0, scale.shape)
            assert np.allclose(scale[has], (plan.stats.num_tokens / np.maximum(total, 1))[has])
            # every token's loss 1: each non-idle micro-step's mean loss is 1, and DDP's
            # average of the ranks' sums over their micro-steps must be the mean, 1
            if plan.num_steps:
                ones = (scale * (plan.stats.num_tokens > 0)).sum(axis=1)
                per_update = np.add.reduceat(ones, plan.windows.starts)
                has_tokens = plan.windows.num_tokens > 0
                assert np.allclose(per_update[has_tokens], 1.0)
    # 5. Budget: every micro-step's group is one the step plan formed (checked above), so
    # padded area <= L unless it is one sample longer than L.
    packed = config.collate is Collate.PACKED
    for _, _, _, group_lengths in groups_of(result):
        if len(group_lengths) > 1:
            area = group_lengths.sum() if packed else group_lengths.max() * len(group_lengths)
            assert int(area) <= config.token_budget
    assert (result.stats().loss_scale[result.stats().num_samples == 0] == 0).all()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(update_scenarios())
def test_same_inputs_same_aligned_plan(scenario):
    # 6. Determinism: every daemon deals the same micro-steps to the same ranks.
    a, b = scenario.run(), scenario.run()
    for pa, pb in zip(a.rounds, b.rounds, strict=True):
        assert np.array_equal(pa.micro_steps, pb.micro_steps)
        for ua, ub in zip(pa.units, pb.units, strict=True):
            assert np.array_equal(ua.emitted.views, ub.emitted.views)
            assert np.array_equal(ua.slot_offsets, ub.slot_offsets)


def test_align_updates_without_updates_is_refused():
    with pytest.raises(ConfigError, match="--align updates .* --accumulate K"):
        dataclasses.replace(make_config(), align=Align.UPDATES)


def uneven_plan():
    """The epoch's last round over two nodes of one rank, --accumulate 4: node 1 has far fewer
    samples, so its rank has idle slots, which it skips."""
    config = dataclasses.replace(
        make_config(world=2, per_node=1, budget=1000, buffer=8, accumulate=4),
        align=Align.UPDATES,
    )
    offers = make_offers(config, [[990, 980, 970, 960, 950], [30, 20]], dry=True)
    return config, plan_round(offers, config, 0)


def test_ranks_run_different_micro_steps_and_the_same_updates():
    config, plan = uneven_plan()
    assert plan.micro_steps is not None
    # node 1 keeps its one group whole (steps would split it), so its rank runs 1 micro-step
    assert (plan.micro_steps.min(axis=1) < plan.micro_steps.max(axis=1)).any(), plan.micro_steps
    assert (rank_runs(plan).sum(axis=0) == plan.micro_steps.sum(axis=0)).all()
    steps = plan_round(
        make_offers(config, [[990, 980, 970, 960, 950], [30, 20]], dry=True),
        dataclasses.replace(config, align=Align.STEPS),
        0,
    )
    assert steps.stats.num_samples[:, 1].astype(bool).sum() > 1  # split into two steps
    c = config.cost.c
    assert update_times(plan, c).sum() <= update_times(steps, c).sum()


def test_dealing_by_cost_shortens_updates():
    """One node of 2 ranks: the step plan's groups, dealt by cost, end the update sooner
    than with every rank running every step, and sooner than the step plan's own dealing."""
    config = dataclasses.replace(
        make_config(world=2, per_node=2, budget=1000, buffer=8, accumulate=4),
        align=Align.UPDATES,
    )
    lengths = [400, 100, 100, 30, 600, 400, 30, 600, 600, 30, 400, 400, 100, 400, 30, 100]
    plan = plan_round(make_offers(config, [lengths]), config, 0)
    steps = dataclasses.replace(config, align=Align.STEPS)
    steps_plan = plan_round(make_offers(config, [lengths]), steps, 0)
    c = config.cost.c
    assert update_times(plan, c).sum() < update_times(steps_plan, c).sum()
    assert steps_plan.stats.num_samples.all()  # no idle slot: the same groups either way
    kept = dataclasses.replace(
        steps_plan, micro_steps=np.full((len(steps_plan.windows), 2), steps_plan.num_steps)
    )
    assert update_times(plan, c).sum() < update_times(kept, c).sum()


def test_each_rank_gets_its_own_update_messages():
    config, plan = uneven_plan()
    numbering = UpdateNumbering(config, DaemonStats(node_rank=0, dataset_size=100))
    shared = numbering.of_round(plan, [0] * plan.num_steps, 0)
    assert plan.micro_steps is not None
    for rank in range(2):
        ends = 0
        for step in range(plan.num_steps):
            u = numbering.of_rank(shared[step], plan, step, rank)
            assert u is not None and u.per_rank
            w = int(plan.windows.of_step()[step])
            mine = int(plan.micro_steps[w, rank])
            position = step - int(plan.windows.starts[w])
            assert u.num_steps == mine
            assert u.skip == (position >= mine)
            if u.end:
                ends += 1
                assert position == mine - 1
                assert u.skipped_after == int(plan.windows.ends[w]) - step - 1
            assert u.num_tokens == int(plan.windows.num_tokens[w])
        assert ends == len(plan.windows)  # every rank ends every update once


def test_steps_alignment_sends_the_shared_message():
    config = make_config(world=4, per_node=2, budget=1000, buffer=8, accumulate=2)
    numbering = UpdateNumbering(config, DaemonStats(node_rank=0, dataset_size=100))
    plan = plan_round(make_offers(config, [[300, 200] * 4, [120, 700] * 4]), config, 0)
    shared = numbering.of_round(plan, [0] * plan.num_steps, 0)
    assert numbering.of_rank(shared[0], plan, 0, 3) is shared[0]


def test_simulate_times_both_alignments():
    from odbd.planner.epoch import simulate

    config = make_config(world=4, per_node=2, budget=2000, buffer=16, accumulate=4)
    aligned = dataclasses.replace(config, align=Align.UPDATES)
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.pareto(1.2, 400) * 100 + 20, 1900).astype(np.int64)
    steps, updates = simulate(lengths, config), simulate(lengths, aligned)
    c = compare_align(steps, updates, config.cost, 1.0)
    assert c.updates == sum(len(p.windows) for p in updates.rounds) > 0
    assert c.updates_time < c.steps_time and c.speedup > 1.0
    assert c.rank_steps_updates < c.rank_steps_steps
    with pytest.raises(ValueError, match="--align updates"):
        compare_align(steps, steps, config.cost, 1.0)
