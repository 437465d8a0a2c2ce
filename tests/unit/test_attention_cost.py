"""Issue 27: packed rows' cost follows the attention kernel (dense over the row, or varlen).

Dense attention (eager/sdpa on CPU) pays the row's length squared, so the planner cuts packed
rows at the cheapest length per token (sqrt(c / b)) instead of filling them to the budget;
varlen attention pays each sample's square, and rows fill the budget as before. The learned
cost model tells the two apart from the step times (--attention auto).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from odbd.config import DaemonConfig
from odbd.errors import ConfigError
from odbd.planner.config import Attention, Collate, CostModel, PlannerConfig
from odbd.planner.cost_fit import (
    VARLEN_MARGIN,
    FitConfig,
    FitState,
    RowFeature,
    choose_shape,
    fit_cost_model,
    row_feature,
)
from odbd.planner.epoch import simulate
from odbd.simulate.distributions import sample_lengths
from odbd.world import World

WORLD = World(4, 2)
BUDGET = 4096
# CPU-like seconds: per token, per squared row length, per step (dense truth of the fits).
TRUE = (5e-5, 5e-8, 0.03)


def packed_config(cost: CostModel, attention: Attention = Attention.VARLEN) -> PlannerConfig:
    return PlannerConfig(
        world=WORLD, token_budget=BUDGET, buffer_size=256, collate=Collate.PACKED,
        cost=cost, attention=attention,
    )  # fmt: skip


def test_dense_rows_pay_the_row_square_and_varlen_the_samples_squares() -> None:
    lengths = np.array([1024, 1024, 1024, 1024], dtype=np.float64)
    row, squares = float(lengths.sum()), float((lengths**2).sum())
    varlen, dense = CostModel(b=1e-3), CostModel(b=1e-3, dense_rows=True)
    assert varlen.work(row, squares) == pytest.approx(row + 1e-3 * squares)
    assert dense.work(row, squares) == pytest.approx(row + 1e-3 * row * row)
    # The CPU measurement: one 4096-token row costs more than 4 rows of 1024.
    assert dense.work(row, squares) > 4 * dense.work(1024.0, 1024.0**2)


def test_dense_rows_are_cut_at_the_cheapest_length_per_token() -> None:
    dense = CostModel(b=1e-3, c=400.0, dense_rows=True)
    assert dense.best_row() == pytest.approx(math.sqrt(400.0 / 1e-3))
    # Per-token cost (c + a S + b S^2) / S is least at best_row: checked on a grid.
    grid = np.arange(64, BUDGET)
    per_token = (dense.c + dense.a * grid + dense.b * grid**2) / grid
    assert abs(int(grid[np.argmin(per_token)]) - dense.best_row()) <= 1
    assert packed_config(dense).row_budget == int(dense.best_row()) == 632
    # Varlen rows, and dense rows whose best length is past the budget, fill the budget.
    assert packed_config(CostModel(b=1e-3, c=400.0)).row_budget == BUDGET
    assert packed_config(CostModel(dense_rows=True)).row_budget == BUDGET  # sqrt(c/b) = 12247
    assert CostModel(b=0.0, dense_rows=True).best_row() == math.inf


def test_a_dense_cost_model_needs_packed_batches() -> None:
    with pytest.raises(ConfigError, match="--collate packed"):
        PlannerConfig(
            world=WORLD, token_budget=BUDGET, buffer_size=64, cost=CostModel(dense_rows=True)
        )


def test_planning_for_dense_attention_beats_filling_rows_to_the_budget() -> None:
    """The whole plan, simulated: rows cut at best_row run faster under dense attention than
    the rows of the varlen plan (filled to the budget), priced the same dense way."""
    lengths = sample_lengths("longtail", 20_000, 0)
    dense = CostModel(a=1.0, b=TRUE[1] / TRUE[0], c=TRUE[2] / TRUE[0], dense_rows=True)
    cut = simulate(lengths, packed_config(dense, Attention.DENSE)).stats()
    filled = simulate(lengths, packed_config(CostModel(a=1.0, b=dense.b, c=dense.c))).stats()

    def dense_time(stats) -> float:  # noqa: ANN001 - StepStats
        rows = stats.padded_tokens.astype(np.float64)  # packed: a rank-step's row length
        return float((dense.c + (rows + dense.b * rows**2).max(axis=1)).sum())

    best = packed_config(dense).row_budget
    assert best < BUDGET
    assert int(cut.padded_tokens.max()) <= max(best, int(lengths.max()))
    assert filled.padded_tokens.mean() > 1.5 * cut.padded_tokens.mean()
    assert dense_time(cut) < 0.9 * dense_time(filled)
    assert cut.real_tokens.sum() == filled.real_tokens.sum() == lengths.sum()


def packed_observations(n: int, *, dense: bool, seed: int = 0, noise: float = 0.03) -> np.ndarray:
    """Packed rank-steps [row length, sum of squares, seconds] of rows of 1-12 samples."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        lengths = rng.integers(16, 700, size=int(rng.integers(1, 13))).astype(np.float64)
        row, squares = float(lengths.sum()), float((lengths**2).sum())
        y = TRUE[0] * row + TRUE[1] * (row * row if dense else squares) + TRUE[2]
        rows.append([row, squares, y * (1 + noise * rng.normal())])
    return np.asarray(rows)


@pytest.mark.parametrize("dense", [True, False])
def test_the_fit_learns_whether_packed_rows_run_dense_or_varlen(dense: bool) -> None:
    fit = fit_cost_model(
        packed_observations(512, dense=dense), CostModel(), FitConfig(), RowFeature.CHOOSE
    )
    assert fit.state is FitState.FITTED
    assert fit.model.dense_rows is dense
    assert set(fit.errors) == {"dense", "varlen"}
    right, wrong = ("dense", "varlen") if dense else ("varlen", "dense")
    assert fit.errors[right] < 0.05
    assert fit.errors[right] < fit.errors[wrong]
    for got, want in zip(fit.seconds, TRUE, strict=True):
        assert got == pytest.approx(want, rel=0.15)


def test_a_fixed_feature_fit_keeps_its_feature() -> None:
    obs = packed_observations(256, dense=True)
    varlen = fit_cost_model(obs, CostModel(), FitConfig(), RowFeature.SAMPLES)
    dense = fit_cost_model(obs, CostModel(), FitConfig(), RowFeature.ROW)
    assert not varlen.model.dense_rows and set(varlen.errors) == {"varlen"}
    assert dense.model.dense_rows and dense.error < varlen.error


def test_the_fit_feature_follows_collate_and_attention() -> None:
    def feature(collate: Collate, attention: Attention) -> RowFeature:
        cost = CostModel(dense_rows=collate is Collate.PACKED and attention is Attention.DENSE)
        return row_feature(
            PlannerConfig(
                world=WORLD,
                token_budget=BUDGET,
                buffer_size=64,
                collate=collate,
                attention=attention,
                cost=cost,
            )  # fmt: skip
        )

    assert feature(Collate.PACKED, Attention.AUTO) is RowFeature.CHOOSE
    assert feature(Collate.PACKED, Attention.DENSE) is RowFeature.ROW
    assert feature(Collate.PACKED, Attention.VARLEN) is RowFeature.SAMPLES
    assert feature(Collate.PADDED, Attention.AUTO) is RowFeature.SAMPLES


def daemon_config(**kwargs: object) -> DaemonConfig:
    return DaemonConfig(world=World(2, 2), node_rank=0, dataset_size=100, **kwargs)  # type: ignore[arg-type]


def test_the_daemon_flag_sets_the_planner_and_the_fingerprint() -> None:
    dense = daemon_config(collate=Collate.PACKED, attention=Attention.DENSE)
    assert dense.planner(100).cost.dense_rows
    assert dense.fingerprint(100)["attention"] == "dense"
    auto = daemon_config(collate=Collate.PACKED)
    assert not auto.planner(100).cost.dense_rows  # varlen until the fit says otherwise
    assert "attention" not in auto.fingerprint(100)  # old daemons still match
    with pytest.raises(ConfigError, match="--attention dense prices packed rows"):
        daemon_config(attention=Attention.DENSE)


def test_rows_take_turns_at_full_half_and_quarter_budget_while_the_fit_warms_up() -> None:
    from odbd.daemon.cost_learning import CostLearner
    from odbd.daemon.round_loop import warmup_planner
    from odbd.planner.cost_fit import CostModelMode

    planner = packed_config(CostModel(), Attention.AUTO)
    learning = CostLearner(CostModelMode.AUTO, planner.cost, FitConfig(), RowFeature.CHOOSE)
    budgets = [warmup_planner(planner, learning, r).row_budget for r in range(6)]
    assert budgets == [BUDGET, BUDGET // 2, BUDGET // 4] * 2
    # Nothing to learn about rows: varlen, padded, or a fixed cost model plan as configured.
    for rows, mode in ((RowFeature.SAMPLES, CostModelMode.AUTO), (RowFeature.CHOOSE,
                       CostModelMode.FIXED)):  # fmt: skip
        same = CostLearner(mode, planner.cost, FitConfig(), rows)
        assert [warmup_planner(planner, same, r) for r in range(3)] == [planner] * 3


def test_ties_go_to_dense_rows_the_shape_that_cannot_blow_up() -> None:
    """Issue 27 run 5: both shapes fitted equally badly (23.4 % each) and varlen, listed first,
    won: rows filled to the budget under a kernel paying the row's square (0.13x). Varlen must
    now beat dense by VARLEN_MARGIN."""
    theta = (1.0, 0.0, 0.0)
    assert choose_shape([(0.234, False, theta), (0.234, True, theta)])[1] is True
    assert choose_shape([(0.22, False, theta), (0.234, True, theta)])[1] is True  # 6 % better
    assert choose_shape([(0.20, False, theta), (0.234, True, theta)])[1] is False  # 15 % better
    assert choose_shape([(0.30, True, theta), (0.10, False, theta)])[1] is False  # order-free
    assert choose_shape([(0.5, False, theta)])[1] is False  # a fixed feature keeps its own


def test_one_sample_rows_where_both_features_agree_fit_dense() -> None:
    """One sample per row: the row's square is the samples' square, the two fits are the same
    fit, and the tie goes to dense (before: varlen, and the next rows filled the budget)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 1000, size=256).astype(np.float64)
    y = (TRUE[0] * lengths + TRUE[1] * lengths**2 + TRUE[2]) * (1 + 0.2 * rng.normal(size=256))
    obs = np.column_stack([lengths, lengths**2, y])
    fit = fit_cost_model(obs, CostModel(), FitConfig(), RowFeature.CHOOSE)
    assert fit.errors["dense"] == fit.errors["varlen"]
    assert fit.model.dense_rows


def test_noisy_data_fitting_both_shapes_equally_badly_picks_dense() -> None:
    """Varlen truth under noise so large that varlen's error is within the margin of dense's:
    dense is kept (shorter rows) rather than a coin flip."""
    obs = packed_observations(256, dense=False, noise=0.6, seed=3)
    fit = fit_cost_model(obs, CostModel(), FitConfig(), RowFeature.CHOOSE)
    varlen, dense = fit.errors["varlen"], fit.errors["dense"]
    assert varlen >= VARLEN_MARGIN * dense  # a near-tie, as in issue 27's run 5
    assert fit.model.dense_rows
