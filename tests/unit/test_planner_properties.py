"""DESIGN.md section 3, items 1-6, as hypothesis properties over random worlds and datasets."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odbd.planner.config import Balance, Collate, CostModel, Grouping, LossScaling, PlannerConfig
from odbd.planner.epoch import simulate
from odbd.planner.ledger import ViewState
from odbd.planner.migration import LinkModel
from odbd.planner.sampler import num_views, sampler_identities
from odbd.simulate.report import repeated_groups
from tests.unit.planner_factories import make_config

# --migrate auto with a link so fast that every balancing move pays: the properties must hold
# for samples moved between nodes (issue 26) as for samples that stay.
FREE_LINK = LinkModel(bytes_per_s=1e30)

PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def scenarios(draw):
    per_node = draw(st.integers(1, 8))
    nodes = draw(st.integers(1, 64 // per_node))
    world = nodes * per_node
    budget = draw(st.integers(1, 3000))
    n = draw(st.integers(0, 300))
    lengths = draw(
        st.lists(
            st.one_of(st.integers(0, 2 * budget), st.integers(1, max(budget // 8, 1))),
            min_size=n,
            max_size=n,
        )
    )
    tokens = [draw(st.integers(0, length)) for length in lengths]
    grouping = draw(st.sampled_from(list(Grouping)))
    balance = draw(st.sampled_from(list(Balance)))
    # Issue 13: packed groups (sum of lengths <= L) and a patch budget, min-time only.
    collate = Collate.PADDED if grouping is Grouping.PAPER else draw(st.sampled_from(list(Collate)))
    max_patches = 0 if grouping is Grouping.PAPER else draw(st.sampled_from([0, 1, 7, 64]))
    patches = [draw(st.sampled_from([0, 0, 1, 3, 16, 80])) for _ in lengths]
    config = make_config(
        world=world,
        per_node=per_node,
        budget=budget,
        buffer=draw(st.integers(1, 24)),
        grouping=grouping,
        balance=balance,
        loss_scaling=draw(st.sampled_from(list(LossScaling))),
        seed=draw(st.integers(0, 3)),
        collate=collate,
        max_patches=max_patches,
    )
    uneven = draw(st.booleans())
    arrivals = (
        [draw(st.integers(1, config.unit_capacity)) for _ in range(config.num_units)]
        if uneven
        else None
    )
    # --cost-model auto refits as the run goes: any sane model, changing between rounds, must
    # keep every guarantee (a = 1 once learned; b and c clamped >= 0; or the fixed default).
    costs = draw(st.lists(cost_models(), max_size=3))
    migration = draw(st.sampled_from([None, FREE_LINK]))
    return Scenario(
        config, np.array(lengths, dtype=np.int64), np.array(tokens, dtype=np.int64), arrivals,
        costs, np.array(patches, dtype=np.int64), migration,
    )  # fmt: skip


class Scenario(NamedTuple):
    config: PlannerConfig
    lengths: np.ndarray
    tokens: np.ndarray
    arrivals: list[int] | None
    costs: list[CostModel]
    patches: np.ndarray  # (N,) vision patches per sample
    migration: LinkModel | None = None  # --migrate auto (migration.py) or off

    def run(self, **kwargs):
        return simulate(
            self.lengths, self.config, tokens=self.tokens, arrivals_per_round=self.arrivals,
            costs=self.costs, patches=self.patches, migration=self.migration, **kwargs,
        )  # fmt: skip


@st.composite
def cost_models(draw):
    return CostModel(
        a=draw(st.sampled_from([1.0, 0.01])),
        b=draw(st.sampled_from([0.0, 1.2e-5, 1e-3, 1.0])),
        c=draw(st.sampled_from([0.0, 1800.0, 1e6])),
        p=draw(st.sampled_from([0.0, 1.0, 10.0])),
    )


def groups_of(result):
    """(epoch, step, rank, views, lengths) of every kept step."""
    position = 0
    for plan, kept in zip(result.rounds, result.steps_kept, strict=True):
        for step in range(kept):
            epoch = int(result.step_epoch[position])
            position += 1
            for rank in range(plan.stats.num_samples.shape[1]):
                yield (
                    epoch,
                    rank,
                    plan.group_views(step, rank, result.ranks_per_unit),
                    plan.group_lengths(step, rank, result.ranks_per_unit),
                )


@PROPERTY_SETTINGS
@given(scenarios(), st.integers(1, 2))
def test_join_mode_properties(scenario, epochs):
    config, lengths, tokens, arrivals = scenario[:4]
    result = scenario.run(epochs=epochs, join=True)
    world = config.world.world_size
    stats = result.stats()
    n = len(lengths)
    m = num_views(n, world)

    # 1. Step alignment: one (steps, W) grid; every rank runs every step of every epoch.
    assert stats.num_samples.shape[1] == world
    for plan in result.rounds:
        for unit in plan.units:
            assert len(unit.slot_offsets) == plan.num_steps * config.ranks_per_unit + 1

    # 2. No loss, no duplication: each epoch's views are all emitted or rejected, once.
    assert len(result.ledgers) == epochs
    for epoch, ledger in enumerate(result.ledgers):
        ledger.check()
        counts = ledger.counts()
        assert counts[ViewState.EMITTED] + counts[ViewState.REJECTED] == m
        emitted = [v for e, _, views, _ in groups_of(result) if e == epoch for v in views]
        assert len(emitted) == len(set(emitted)) == counts[ViewState.EMITTED]
        identities = sampler_identities(n, world, seed=config.seed, epoch=epoch)
        done = set(result.sample_ids(np.array(emitted, dtype=np.int64)).tolist())
        done |= set(identities[ledger.views_in(ViewState.REJECTED)].tolist())
        assert done == set(range(n))

    # 3. Bounded termination: O(N/W + buffer) rounds per epoch (Theorem 4). A unit whose
    # producers deliver fewer samples per round than it has ranks needs proportionally more.
    per_unit = m // config.num_units
    rate = min(min(arrivals or [config.unit_capacity]), config.ranks_per_unit)
    assert len(result.rounds) <= epochs * (math.ceil(per_unit / rate) + 2 * config.buffer_size + 2)

    check_budget_and_scaling(result, config, scenario.patches)


@PROPERTY_SETTINGS
@given(scenarios(), st.integers(1, 3))
def test_non_join_reaches_the_sample_quota(scenario, epochs):
    config, lengths = scenario.config, scenario.lengths
    result = scenario.run(epochs=epochs, join=False)
    stats = result.stats()
    per_step = stats.global_num_samples
    consumed = int(per_step.sum()) + result.num_rejected
    quota = epochs * len(lengths)
    s_max = int(per_step.max()) if per_step.size else 0
    # Theorem 2; views rejected at ingest (0-length) count as consumed, so none is lost.
    assert quota <= consumed <= quota + max(s_max, result.num_rejected) or quota == 0
    for ledger in result.ledgers:
        ledger.check()  # every view in exactly one state, across chained iterations
    assert set(result.step_epochs().tolist()) <= set(range(epochs))
    assert np.all(np.diff(result.step_epochs()) >= 0)
    check_budget_and_scaling(result, config, scenario.patches)


def check_budget_and_scaling(result, config, patches):
    stats = result.stats()
    # 5. Budget: padded area <= L (packed: sum of lengths <= L) unless the group is one sample
    # longer than L, which is a group of one; with --max-patches the group's patches <= N
    # unless it is one sample with more.
    packed = config.collate is Collate.PACKED
    for _, _, views, lengths in groups_of(result):
        if len(lengths) > 1:
            area = int(lengths.sum()) if packed else int(lengths.max()) * len(lengths)
            assert area <= config.token_budget
            if config.max_patches:
                assert int(patches[result.sample_ids(views)].sum()) <= config.max_patches
    if packed:  # padding-free: the padded tokens are the real ones
        assert np.array_equal(stats.padded_tokens, stats.real_tokens)
    # 4. Exact loss scaling: sum_r scale_r * t_r / W == per-token total / total tokens == 1
    # when every token's loss is 1, and sum_r scale_r * mean_r / W is the per-token mean.
    if config.loss_scaling is LossScaling.EXACT:
        has_tokens = stats.global_num_tokens > 0
        weighted = (stats.loss_scale * (stats.num_tokens > 0)).sum(
            axis=1
        ) / stats.num_samples.shape[1]
        contributes = stats.num_tokens / np.maximum(stats.global_num_tokens, 1)[:, None]
        assert np.allclose(
            (stats.loss_scale / stats.num_samples.shape[1])[has_tokens],
            contributes[has_tokens],
        )
        assert np.all(weighted[has_tokens] <= stats.num_samples.shape[1] + 1e-9)
    assert (stats.loss_scale[stats.num_samples == 0] == 0).all()


@settings(max_examples=25, deadline=None)
@given(scenarios(), st.booleans())
def test_same_inputs_same_plan(scenario, join):
    # 6. Determinism: the plan is a pure function of seed, lengths and world.
    a = scenario.run(join=join)
    b = scenario.run(join=join)
    assert a.steps_kept == b.steps_kept
    for pa, pb in zip(a.rounds, b.rounds, strict=True):
        for ua, ub in zip(pa.units, pb.units, strict=True):
            assert np.array_equal(ua.emitted.views, ub.emitted.views)
            assert np.array_equal(ua.slot_offsets, ub.slot_offsets)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 4),
    st.integers(1, 2),
    st.integers(2000, 4000),
    st.lists(st.integers(100, 1000), min_size=200, max_size=400, unique=True),
    st.integers(0, 3),
)
def test_two_epochs_over_a_whole_dataset_buffer_form_different_groups(
    per_node, nodes, budget, lengths, seed
):
    """Issue 10: a buffer holding the whole dataset cut the same groups every epoch.

    The two epochs must differ (CI once found a sparse buffer whose epochs repeated every group,
    before the swaps across cuts). TODO(fresh-groups): no bound on the repeated share yet; it is
    at most 0.58 over 150 random buffers of this shape, and 0.7-3 % on the named distributions
    with a buffer holding the whole dataset (singletons longer than L/2 excepted)."""
    world = per_node * nodes
    config = make_config(
        world=world, per_node=per_node, budget=budget, buffer=len(lengths), seed=seed
    )
    result = simulate(np.asarray(lengths, dtype=np.int64), config, epochs=2)
    freshness = repeated_groups(result.iter_steps())
    assert freshness.groups > 0
    assert freshness.repeated < freshness.groups, freshness


def test_a_whole_dataset_buffer_of_sparse_lengths_flushes_different_groups_every_epoch():
    # Each epoch is one round that flushes (node_plan._flush_cut): over 204 distinct lengths
    # in [100, 1000] the jittered order barely moves, and the cut of least largest work
    # repeated all 32 groups of epoch 0 in epoch 1 until its groups were swapped across random
    # cuts like the greedy ones (a random draw of the property above found the first case).
    lengths = np.sort(np.random.default_rng(38).choice(np.arange(100, 1001), 204, replace=False))
    config = make_config(world=2, per_node=2, budget=3931, buffer=len(lengths), seed=0)
    freshness = repeated_groups(simulate(lengths.astype(np.int64), config, epochs=2).iter_steps())
    assert freshness.groups > 0
    assert freshness.repeated < freshness.groups, freshness
