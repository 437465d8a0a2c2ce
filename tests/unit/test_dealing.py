"""dealing.py: trades between one step's groups keep every sample once and the budget, and
lower the step's costliest group where a trade can."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.planner.config import CostModel
from odbd.planner.dealing import even_steps

BUDGET = 1000
COST = CostModel()


def _work(rows: np.ndarray, lengths: np.ndarray) -> float:
    ls = lengths[rows].astype(np.float64)
    return float(COST.work(ls[0] * len(ls), float(ls @ ls))) if len(ls) else 0.0


def test_a_trade_lowers_the_steps_costliest_group() -> None:
    # One step, two ranks: {400, 350} (area 800) and {100}; trading 400 for 100 leaves
    # {350, 100} (700) and {400}: the step's costliest rank drops from 800 to 700 tokens.
    lengths = np.array([400, 350, 100])
    order = np.arange(3)
    starts, ends = np.array([0, 2]), np.array([2, 3])
    group_of_slot = np.array([0, 1])
    before = max(_work(order[0:2], lengths), _work(order[2:3], lengths))
    new_order, new_starts, new_ends = even_steps(
        order, starts, ends, group_of_slot, lengths, 2, BUDGET, COST
    )
    groups = [new_order[s:e] for s, e in zip(new_starts, new_ends, strict=True)]
    after = max(_work(g, lengths) for g in groups)
    assert after < before - 90
    assert sorted(lengths[g].tolist() for g in groups) == [[350, 100], [400]]
    assert sorted(new_order.tolist()) == list(range(3))
    for g in groups:
        assert lengths[g[0]] * len(g) <= BUDGET


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 1400), min_size=1, max_size=60),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_every_sample_once_budget_kept_and_no_step_slower(
    raw: list[int], g: int, rnd: object
) -> None:
    lengths = np.array(raw, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    # Greedy groups of the sorted lengths, as grouping.py cuts them, padded with idle slots.
    starts: list[int] = []
    i = 0
    while i < len(order):
        starts.append(i)
        i += max(BUDGET // int(lengths[order[i]]), 1)
        i = min(i, len(order))
    ends = [*starts[1:], len(order)]
    while len(starts) % g:
        starts.append(len(order))
        ends.append(len(order))
    s, e = np.array(starts), np.array(ends)
    perm = np.array(rnd.sample(range(len(starts)), len(starts)))  # type: ignore[attr-defined]
    new_order, ns, ne = even_steps(order, s, e, perm, lengths, g, BUDGET, COST)
    assert sorted(new_order.tolist()) == sorted(order.tolist())
    for step in range(len(starts) // g):
        old = [order[s[k] : e[k]] for k in perm[step * g : (step + 1) * g]]
        new = [new_order[ns[k] : ne[k]] for k in range(step * g, (step + 1) * g)]
        assert [len(x) == 0 for x in old] == [len(x) == 0 for x in new]  # idle stays idle
        assert max(_work(x, lengths) for x in new) <= max(_work(x, lengths) for x in old)
        for x in new:
            if len(x):
                assert (np.diff(lengths[x]) <= 0).all()  # longest first
                assert len(x) == 1 or lengths[x[0]] * len(x) <= BUDGET
    again = even_steps(order, s, e, perm, lengths, g, BUDGET, COST)
    assert all((a == b).all() for a, b in zip(again, (new_order, ns, ne), strict=True))
