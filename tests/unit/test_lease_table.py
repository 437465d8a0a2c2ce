"""LeaseTable (the daemon's lease state as columns) against a dict model: grants, holder
lookups, ends, expiry and a producer's leases agree after any sequence of operations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.daemon.leases import NO_HOLDER, LeaseTable
from odbd.planner.view_keys import by_iteration

M = 7  # views per iteration: keys 0..27 span 4 iterations

_ops = st.lists(
    st.tuples(
        st.sampled_from(["grant", "end"]),
        st.lists(st.integers(0, 4 * M - 1), min_size=0, max_size=10, unique=True),
        st.integers(0, 3),  # producer
        st.floats(0.0, 10.0),  # deadline
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(_ops, st.floats(0.0, 10.0))
def test_lease_table_agrees_with_a_dict_of_holders(ops: list, now: float) -> None:
    table, model = LeaseTable(M), {}  # model: key -> (producer, deadline)
    for op, keys, producer, deadline in ops:
        if op == "grant":
            free = [k for k in keys if k not in model]
            table.grant(np.asarray(free, np.int64), producer, deadline)
            model.update(dict.fromkeys(free, (producer, deadline)))
        else:
            held = [k for k in keys if k in model]
            table.end(np.asarray(held, np.int64))
            for k in held:
                del model[k]
        probe = np.arange(-2, 5 * M, dtype=np.int64)  # unleased, other iterations, negative
        expected = [model[k][0] if k in model else NO_HOLDER for k in probe.tolist()]
        assert table.holders(probe).tolist() == expected
        assert [table.holder(k) for k in probe.tolist()] == expected
        assert len(table) == len(model)
        assert table.keys().tolist() == sorted(model)
        assert table.producers() == {p for p, _ in model.values()}
    for producer in range(4):
        mine = sorted(k for k, (p, _) in model.items() if p == producer)
        assert table.keys_of(producer).tolist() == mine
    assert table.expired(now).tolist() == sorted(k for k, (_, d) in model.items() if d <= now)


def test_idle_iterations_columns_are_dropped_when_another_iteration_is_granted() -> None:
    table = LeaseTable(1000)
    table.grant(np.arange(10, dtype=np.int64), producer=0, deadline=1.0)
    table.end(np.arange(10, dtype=np.int64))
    table.grant(np.arange(10, dtype=np.int64), producer=0, deadline=1.0)  # same iteration: kept
    assert len(table._holder) == 1
    table.end(np.arange(10, dtype=np.int64))
    table.grant(np.arange(1000, 1005, dtype=np.int64), producer=1, deadline=1.0)
    assert list(table._holder) == [1] and len(table) == 5


def test_an_empty_dataset_has_no_holders() -> None:
    table = LeaseTable(0)
    assert table.holders(np.asarray([0, 5], np.int64)).tolist() == [NO_HOLDER, NO_HOLDER]
    assert table.holder(3) == NO_HOLDER and len(table) == 0


@pytest.mark.parametrize("keys", [[3, 4, 5], [3, 9, 4, 20], [], [13]])
def test_by_iteration_splits_keys_like_a_mask_per_iteration(keys: list[int]) -> None:
    array = np.asarray(keys, np.int64)
    parts = [
        (it, array[rows].tolist(), views.tolist()) for it, rows, views in by_iteration(array, M)
    ]
    expected = [
        (it, [k for k in keys if k // M == it], [k % M for k in keys if k // M == it])
        for it in sorted({k // M for k in keys})
    ]
    assert parts == expected
