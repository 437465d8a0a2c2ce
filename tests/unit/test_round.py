import numpy as np
import pytest

from odbd.errors import InvariantError
from odbd.planner.config import Balance, Grouping, LossScaling
from odbd.planner.round import plan_round
from odbd.planner.types import SampleTable, UnitOffer
from tests.unit.planner_factories import make_config, make_offers, make_table


def test_every_rank_gets_the_round_step_count():
    config = make_config(world=4, per_node=2, budget=1000, buffer=8)
    plan = plan_round(make_offers(config, [[300] * 16, [120] * 16]), config, 0)
    assert plan.stats.num_samples.shape == (plan.num_steps, 4)
    for unit in plan.units:
        assert unit.slot_offsets.shape == (plan.num_steps * 2 + 1,)


def test_emitted_plus_leftover_is_the_offer():
    config = make_config(world=4, per_node=2, budget=1000, buffer=8)
    offers = make_offers(config, [[300] * 16, [120] * 5 + [900] * 3])
    plan = plan_round(offers, config, 0)
    for offer, unit in zip(offers, plan.units, strict=True):
        got = np.concatenate([unit.emitted.views, unit.leftover.views])
        assert sorted(got.tolist()) == sorted(offer.samples.views.tolist())
        assert (unit.leftover.ages == 1).all()


def test_group_views_addresses_each_rank_and_step():
    config = make_config(world=2, per_node=2, budget=1000, buffer=4)
    plan = plan_round(make_offers(config, [[500] * 4]), config, 0)
    seen = []
    for step in range(plan.num_steps):
        for rank in range(2):
            views = plan.group_views(step, rank, 2)
            assert len(views) == plan.stats.num_samples[step, rank]
            seen += views.tolist()
    assert sorted(seen) == [0, 1, 2, 3]


def test_exact_loss_scale_reproduces_the_per_token_mean():
    config = make_config(world=4, per_node=2, budget=1000, buffer=8)
    rng = np.random.default_rng(3)
    offers = []
    for unit in range(2):
        lengths = rng.integers(20, 400, size=12)
        tokens = rng.integers(0, lengths + 1)
        views = np.arange(unit * 100, unit * 100 + 12)
        offers.append(UnitOffer(unit, SampleTable.of(views, lengths, tokens), True))
    plan = plan_round(offers, config, 0)
    per_token_loss = {
        int(v): rng.normal(size=int(t))
        for o in offers
        for v, t in zip(o.samples.views, o.samples.tokens, strict=True)
    }
    for step in range(plan.num_steps):
        total, count, ddp = 0.0, 0, 0.0
        for rank in range(4):
            losses = np.concatenate(
                [per_token_loss[int(v)] for v in plan.group_views(step, rank, 2)] + [np.zeros(0)]
            )
            total += losses.sum()
            count += losses.size
            mean = losses.mean() if losses.size else 0.0
            ddp += plan.stats.loss_scale[step, rank] * mean / 4
        if count:
            assert ddp == pytest.approx(total / count, rel=1e-12)


@pytest.mark.parametrize("mode", list(LossScaling))
def test_idle_fillers_have_zero_loss_scale(mode):
    config = make_config(world=4, per_node=2, budget=1000, buffer=8, loss_scaling=mode)
    plan = plan_round(make_offers(config, [[100] * 30, [100]], dry=True), config, 0)
    idle = plan.stats.num_samples == 0
    assert idle.any()
    assert (plan.stats.loss_scale[idle] == 0).all()


def test_sample_and_none_scaling_are_not_token_weighted():
    config = make_config(
        world=2,
        per_node=1,
        budget=1000,
        buffer=8,
        balance=Balance.NODE,
        loss_scaling=LossScaling.SAMPLE,
    )
    offers = make_offers(config, [[100, 100], [400]], dry=True)
    plan = plan_round(offers, config, 0)
    assert plan.stats.loss_scale.sum(axis=1) == pytest.approx([2.0] * plan.num_steps)


def test_offers_must_cover_every_unit_in_order():
    config = make_config(world=4, per_node=2)
    with pytest.raises(InvariantError, match="one offer per unit"):
        plan_round(make_offers(config, [[100]]), config, 0)


@pytest.mark.parametrize("grouping", list(Grouping))
def test_same_offers_same_plan(grouping):
    config = make_config(world=4, per_node=2, budget=700, buffer=8, grouping=grouping)
    rng = np.random.default_rng(7)
    per_unit = [rng.integers(1, 900, size=16).tolist() for _ in range(2)]
    a = plan_round(make_offers(config, per_unit), config, 3)
    b = plan_round(make_offers(config, per_unit), config, 3)
    assert a.num_steps == b.num_steps
    for ua, ub in zip(a.units, b.units, strict=True):
        assert ua.emitted.views.tolist() == ub.emitted.views.tolist()
        assert ua.slot_offsets.tolist() == ub.slot_offsets.tolist()


def test_min_time_balances_step_costs_within_a_node():
    config = make_config(world=8, per_node=8, budget=1000, buffer=64)
    lengths = [900] * 8 + [100] * 80
    plan = plan_round([UnitOffer(0, make_table(lengths), True)], config, 0)
    work = plan.stats.work
    assert (work.max(axis=1) <= 1.2 * work.mean(axis=1)).all()
