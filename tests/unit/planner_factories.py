"""Factories for planner tests (like vllm's create_scheduler): configs, tables, offers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from odbd.planner.config import Balance, Collate, Grouping, LossScaling, PlannerConfig
from odbd.planner.types import SampleTable, UnitOffer
from odbd.world import World


def make_config(
    world: int = 4,
    per_node: int = 2,
    budget: int = 1000,
    buffer: int = 8,
    grouping: Grouping = Grouping.MIN_TIME,
    balance: Balance = Balance.NODE,
    loss_scaling: LossScaling = LossScaling.EXACT,
    seed: int = 0,
    accumulate: int = 1,
    tokens_per_update: int = 0,
    collate: Collate = Collate.PADDED,
    max_patches: int = 0,
) -> PlannerConfig:
    return PlannerConfig(
        world=World(world, per_node),
        token_budget=budget,
        buffer_size=buffer,
        grouping=grouping,
        balance=balance,
        loss_scaling=loss_scaling,
        seed=seed,
        accumulate=accumulate,
        tokens_per_update=tokens_per_update,
        collate=collate,
        max_patches=max_patches,
    )


def make_table(lengths: Sequence[int], first_view: int = 0) -> SampleTable:
    views = np.arange(first_view, first_view + len(lengths))
    return SampleTable.of(views, lengths)


def make_offers(
    config: PlannerConfig, per_unit: Sequence[Sequence[int]], dry: bool = False
) -> list[UnitOffer]:
    """One offer per unit; view ids are unique across units."""
    offers = []
    first = 0
    for unit, lengths in enumerate(per_unit):
        offers.append(UnitOffer(unit, make_table(lengths, first), dry))
        first += len(lengths)
    return offers
