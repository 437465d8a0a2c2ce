"""The round loop's per-round arrays: the epoch's identity count kept as identities are marked
(no O(dataset) sum per round) and per-slot sums of the cost model's features."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.daemon.round_loop import EpochTally, _slot_sums


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 19), max_size=12), max_size=8))
def test_the_identity_count_is_the_number_of_distinct_identities_marked(
    rounds: list[list[int]],
) -> None:
    tally = EpochTally(0, 0, np.zeros(20, dtype=bool), Counter())
    for identities in rounds:  # repeats within and across rounds (the sampler's padding)
        tally.mark_seen(np.asarray(identities, dtype=np.int64))
        assert tally.seen is not None
        assert tally.num_seen == int(tally.seen.sum())
    assert tally.num_seen == len({i for r in rounds for i in r})


def test_slot_sums_are_the_sums_of_each_slots_rows_and_zero_for_an_idle_slot() -> None:
    values = np.asarray([3, 4, 5, 6, 7], dtype=np.int64)
    offsets = np.asarray([0, 2, 2, 5, 5])  # slots: rows 0-1, none (idle), rows 2-4, none
    assert _slot_sums(values, offsets, 4) == [7.0, 0.0, 18.0, 0.0]
    assert _slot_sums(values, offsets, 2) == [7.0, 0.0]  # the kept slots only
