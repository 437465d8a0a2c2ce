"""The refusal log's budget: 5 lines per 10 s, the next logged line counts the ones left out."""

from odbd.round.log_budget import LogBudget


def test_a_flood_logs_the_burst_then_counts_the_rest_in_the_next_window() -> None:
    budget = LogBudget(burst=5, window_s=10.0)
    admitted = [budget.admit(0.001 * i) for i in range(3000)]  # 3,000 refusals in 3 s
    assert [a for a in admitted if a[0]] == [(True, 0)] * 5
    assert budget.admit(10.0) == (True, 2995)  # the next window says what was left out
    assert budget.admit(10.1) == (True, 0)


def test_a_trickle_is_logged_in_full() -> None:
    budget = LogBudget(burst=5, window_s=10.0)
    assert all(budget.admit(3.0 * i)[0] for i in range(100))
