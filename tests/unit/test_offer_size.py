"""Round payloads that cannot fit the round message are refused at start-up, not at the first
round; the live round's summaries follow the units, not --buffer (issue 25)."""

from __future__ import annotations

import numpy as np
import pytest

from odbd.daemon.offer_codec import NodeOffer, encode, full_buffer_offer_bytes
from odbd.daemon.split_round import check_summary_fits, summary_bytes_bound
from odbd.errors import ConfigError
from odbd.planner.config import Balance
from odbd.planner.types import SampleTable, UnitOffer
from odbd.round.config import max_payload_bytes
from tests.unit.planner_factories import make_config


def full_offer(buffered: int) -> bytes:
    rows = np.arange(buffered, dtype=np.int64)
    table = SampleTable(rows, rows, rows, rows, rows)
    rejected = {"schema_mismatch": 3, "unsupported_value": 1}
    observations = np.ones((64, 3))  # the most cost observations one offer carries
    return encode(NodeOffer(5, 2, (UnitOffer(5, table, False),), rejected, (2, 7), observations))


def test_full_buffer_bound_covers_a_real_encoded_offer() -> None:
    for buffered in (0, 1, 8 * 1024):
        assert len(full_offer(buffered)) <= full_buffer_offer_bytes(buffered)


def test_w8192_with_8_ranks_per_node_is_accepted_whatever_the_buffer() -> None:
    """Issue 25: the full offers of --buffer 1024 x 8 ranks (196 KiB) were over a node's 64 KiB
    share at 1024 nodes ("Pass --buffer 319 or less"); summaries are ~14 KiB at most."""
    for balance in Balance:
        for buffer in (1024, 65536):
            config = make_config(world=8192, per_node=8, buffer=buffer, balance=balance)
            check_summary_fits(config)
            assert summary_bytes_bound(config) <= max_payload_bytes(1024)
    check_summary_fits(make_config(world=8, per_node=8, buffer=1024))


def test_a_summary_over_the_node_share_is_refused_naming_the_fix() -> None:
    config = make_config(world=8192, per_node=1, buffer=8)  # 8192 nodes: 8 KiB each
    with pytest.raises(ConfigError, match=r"8192 nodes of 1 ranks make round summaries of up "):
        check_summary_fits(config)


def test_the_summary_bound_covers_a_real_summary_with_every_side_fact() -> None:
    from odbd.daemon import split_round, summary_codec
    from odbd.planner import company

    layouts = ((1, 8, Balance.RANK), (2, 4, Balance.NODE), (128, 8, Balance.RANK))
    for nodes, per_node, balance in layouts:
        world = nodes * per_node
        config = make_config(
            world=world, per_node=per_node, budget=64, buffer=1100, balance=balance
        )
        rng = np.random.default_rng(0)
        units = range(config.num_units // nodes)
        offers = []
        for u in units:
            lengths = rng.integers(100, 3000, 1100 * config.ranks_per_unit)  # all over the budget
            offers.append(UnitOffer(u, SampleTable.of(np.arange(len(lengths)), lengths), False))
        side = summary_codec.NodeSummary(
            0, 3, (), {"schema_mismatch": 3, "unsupported_value": 1}, (2, 7), np.ones((64, 3)),
            (12345, "x" * 1000), tuple((r, 1, 2) for r in range(per_node)),
        )  # fmt: skip
        grouped, payload = split_round.node_summary(side, offers, config, 0)
        assert any(len(g.profile) == company.PROFILE_DEPTH for g in grouped)
        assert len(payload) <= summary_bytes_bound(config), (nodes, len(payload))
