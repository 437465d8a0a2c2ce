"""The round loop's per-round arrays: per-slot sums of the cost model's features (the epoch's
identity count: tests/unit/test_identities.py)."""

from __future__ import annotations

import numpy as np

from odbd.daemon.step_columns import slot_sums


def test_slot_sums_are_the_sums_of_each_slots_rows_and_zero_for_an_idle_slot() -> None:
    values = np.asarray([3, 4, 5, 6, 7], dtype=np.int64)
    offsets = np.asarray([0, 2, 2, 5, 5])  # slots: rows 0-1, none (idle), rows 2-4, none
    assert slot_sums(values, offsets, 4) == [7.0, 0.0, 18.0, 0.0]
    assert slot_sums(values, offsets, 2) == [7.0, 0.0]  # the kept slots only
