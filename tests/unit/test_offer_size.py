"""Offers that cannot fit the round message are refused at start-up, not at the first round."""

from __future__ import annotations

import numpy as np
import pytest

from odbd.daemon.offer_codec import (
    NodeOffer,
    check_offer_fits,
    encode,
    full_buffer_offer_bytes,
)
from odbd.errors import ConfigError
from odbd.planner.types import SampleTable, UnitOffer
from odbd.round.config import max_payload_bytes


def full_offer(buffered: int) -> bytes:
    rows = np.arange(buffered, dtype=np.int64)
    table = SampleTable(rows, rows, rows, rows, rows)
    rejected = {"schema_mismatch": 3, "unsupported_value": 1}
    observations = np.ones((64, 3))  # the most cost observations one offer carries
    return encode(NodeOffer(5, 2, (UnitOffer(5, table, False),), rejected, (2, 7), observations))


def test_full_buffer_bound_covers_a_real_encoded_offer() -> None:
    for buffered in (0, 1, 8 * 1024):
        assert len(full_offer(buffered)) <= full_buffer_offer_bytes(buffered)


def test_layouts_that_fit_pass() -> None:
    check_offer_fits(1024, 8, 1)
    check_offer_fits(1024, 8, 128)  # W = 1024


def test_a_full_offer_over_the_node_share_is_refused_with_the_buffer_that_fits() -> None:
    with pytest.raises(ConfigError, match=r"--buffer 1024 with 8 ranks per node") as error:
        check_offer_fits(1024, 8, 1024)  # W = 8192: 196 KiB offers, 64 KiB per node
    fits = int(str(error.value).rsplit("--buffer ", 1)[1].split()[0])
    assert full_buffer_offer_bytes(fits * 8) <= max_payload_bytes(1024)
    assert full_buffer_offer_bytes((fits + 1) * 8) > max_payload_bytes(1024)
    check_offer_fits(fits, 8, 1024)
