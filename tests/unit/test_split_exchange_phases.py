"""The barrier rounds of one live round's exchanges (split_exchange.py) with --migrate auto
and --align updates together: the moves' exchange first, then the summaries, the totals and
the deals, 4 per round, all through SplitExchange (so through the same barrier and tree)."""

from __future__ import annotations

import asyncio
import dataclasses

from odbd.daemon import summary_codec
from odbd.daemon.split_exchange import SplitExchange, exchanges_per_round
from odbd.planner.config import Align
from odbd.round.barrier import RoundRecord
from tests.unit.planner_factories import make_config, make_offers


class OneNodeBarrier:
    """A barrier of one daemon (the hub): each exchange's result is reduce([payload])."""

    def __init__(self) -> None:
        self.rounds: list[int] = []
        self.last_round: RoundRecord | None = None

    async def exchange_reduced(self, round_index, payload, reduce):  # noqa: ANN001, ANN201
        self.rounds.append(round_index)
        self.last_round = RoundRecord(round_index, 0.0, 0)
        return reduce([payload])


def _run(config, round_index: int) -> list[int]:
    barrier = OneNodeBarrier()
    split = SplitExchange.of(barrier, 0, config)  # type: ignore[arg-type]
    offers = make_offers(config, [[500, 400, 300, 200, 100, 90]], dry=True)

    async def one_round() -> None:
        if config.migrate:
            assert await split.moves(round_index, b"digest", lambda p: p[0] + b"!") == b"digest!"
        side = summary_codec.NodeSummary(0, 0, ())
        grouped, decided = await split.decide(
            round_index,
            round_index,
            side,
            offers,
            config,
            lambda _: None,  # type: ignore[arg-type,return-value]
        )
        assert decided.decision is not None
        await split.complete(round_index, grouped, decided.decision, config)

    asyncio.run(one_round())
    return barrier.rounds


def test_moves_then_summaries_totals_and_deals_are_four_barrier_rounds_per_round():
    base = make_config(world=2, per_node=2, budget=1000, buffer=8, accumulate=2)
    both = dataclasses.replace(base, align=Align.UPDATES, migrate=True)
    assert exchanges_per_round(both) == 4
    assert _run(both, 5) == [20, 21, 22, 23]
    moves_only = dataclasses.replace(base, migrate=True)
    assert exchanges_per_round(moves_only) == 3
    assert _run(moves_only, 5) == [15, 16, 17]
    updates_only = dataclasses.replace(base, align=Align.UPDATES)
    assert _run(updates_only, 5) == [15, 16, 17]
    assert _run(base, 5) == [10, 11]  # neither: as before
