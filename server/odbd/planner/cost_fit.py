"""The cost model learned from the run: a robust fit of rank-step compute time (pure).

Each observation is one rank-step the trainer timed itself (`ODBClient.report_compute`): the
step's padded tokens P, its sum of squared lengths S and the measured seconds y. The fit is a
Huber regression y ~ a*P + b*S + c by iteratively reweighted least squares, so a step slowed
by something else (a checkpoint, a noisy neighbour) barely moves it.

Every daemon runs this on the same observations (they travel in the round payloads) and must
get bit-identical coefficients, or plans diverge. So the arithmetic is chosen to be exact and
order-free: element-wise numpy operations are correctly rounded IEEE operations, every sum is
`math.fsum` (correctly rounded, so independent of the order and of the platform's SIMD or
BLAS), medians depend only on the values, and the 3x3 solve is plain Python floats. The result
does not depend on the order of the rows, nor on which machine runs it.

Coefficients are clamped to what the physics allows: b >= 0 and c >= 0 (longer samples never
cost less, a step never saves time), and a >= A_FLOOR of the run's average seconds per padded
token (every token runs the MLPs; a non-positive a would only mean that a and c could not be
told apart, which happens when nearly every group fills the budget). The planner gets the fit in
token-equivalents (a = 1, DESIGN.md section 4), so only the ratios b/a and c/a change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from odbd.errors import ConfigError
from odbd.planner.config import Attention, Collate, CostModel, PlannerConfig
from odbd.planner.types import FloatArray

HUBER_K = 1.345  # 95 % efficiency under Gaussian noise; residuals beyond k sigma weigh less
MAD_TO_SIGMA = 1.4826
A_FLOOR = 0.01  # a >= 1 % of the average seconds per padded token (see the module docstring)
# --attention auto keeps varlen only if its error is below this fraction of dense's: on a tie
# (both fit equally badly, or one sample per row where the features agree) dense wins, the
# shape that cannot blow up: wrongly dense only shortens rows (more steps), wrongly varlen
# fills them to the budget under a kernel that pays the row's square (0.13x in issue 27).
VARLEN_MARGIN = 0.9
# Columns of an observation array (n, 3): float64.
PADDED, SUM_SQ, SECONDS = 0, 1, 2


class CostModelMode(StrEnum):
    """--cost-model: where the planner's cost model comes from."""

    AUTO = "auto"  # fitted from the trainers' step times after a warm-up, fixed until then
    FIXED = "fixed"  # the fixed coefficients throughout (plans independent of timing)


class RowFeature(StrEnum):
    """The quadratic feature of a rank-step in the fit: attention's cost."""

    SAMPLES = "samples"  # sum of the samples' squared lengths (padded rows; varlen packed rows)
    ROW = "row"  # the packed row's length squared (dense attention over the row)
    CHOOSE = "choose"  # fit both, keep the better (--attention auto with --collate packed)


class FitState(StrEnum):
    FIXED = "fixed"  # --cost-model fixed
    WARMUP = "warmup"  # fewer observations than the warm-up needs
    ILL_CONDITIONED = "ill-conditioned"  # tokens, sum l^2 and steps cannot be told apart
    FITTED = "fitted"


@dataclass(frozen=True, kw_only=True, slots=True)
class FitConfig:
    """How the cost model is learned; identical on every daemon (fingerprinted)."""

    warmup: int = 64  # observations before the first fit
    window: int = 512  # the newest observations the fit uses
    iterations: int = 12  # IRLS iterations: fixed, so every daemon does the same arithmetic
    # Below this, the columns (P, S, 1) are nearly dependent (e.g. every length equal: S = l*P)
    # and a fit would split the time between them arbitrarily: keep the fixed model.
    min_independence: float = 1e-7

    def __post_init__(self) -> None:
        if self.warmup < 3 or self.window < self.warmup:
            raise ConfigError(
                f"cost fit needs 3 <= warmup <= window observations, got warmup {self.warmup} "
                f"window {self.window}"
            )
        if self.iterations < 1:
            raise ConfigError(f"cost fit needs >= 1 iteration, got {self.iterations}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CostFit:
    """The cost model the planner uses, and how it was obtained."""

    model: CostModel  # token-equivalents, what plan_round uses
    state: FitState
    # Seconds per padded token, per squared length, per step; 0 unless state is FITTED.
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # Median of |predicted - measured| / measured over the window: the fit's, and the fixed
    # model's scaled by its best single factor (how wrong its shape is); nan without a fit.
    error: float = math.nan
    fixed_error: float = math.nan
    num_observations: int = 0
    # Median relative error of each quadratic feature the fit tried ("varlen", "dense").
    errors: dict[str, float] = field(default_factory=dict)


def fit_cost_model(
    observations: FloatArray,
    fixed: CostModel,
    config: FitConfig,
    rows: RowFeature = RowFeature.SAMPLES,
) -> CostFit:
    """The Huber fit of `observations` (n, 3): [padded, sum_sq, seconds] per rank-step.

    `rows` says which quadratic feature the fit uses (RowFeature); CHOOSE fits both and keeps
    the one with the smaller median relative error, which is how --attention auto learns
    whether packed rows run dense or varlen attention. Falls back to `fixed` before the
    warm-up and when the columns are nearly dependent.
    """
    obs = np.asarray(observations, dtype=np.float64).reshape(-1, 3)
    # Idle fillers (P = 0) and clock glitches (y <= 0) say nothing about the model.
    obs = obs[(obs[:, PADDED] > 0) & (obs[:, SECONDS] > 0)]
    n = int(obs.shape[0])
    if n < config.warmup:
        return CostFit(model=fixed, state=FitState.WARMUP, num_observations=n)
    y = obs[:, SECONDS]
    fixed_square = obs[:, PADDED] ** 2 if fixed.dense_rows else obs[:, SUM_SQ]
    fixed_x = np.column_stack([obs[:, PADDED], fixed_square, np.ones(n)])
    fixed_error = _scaled_error(fixed_x @ np.array([fixed.a, fixed.b, fixed.c]), y)
    candidates = []
    for dense in _dense_options(rows):
        # Dense attention: a packed row's padded tokens are its length (with vision patches
        # as p token-equivalents each: an approximation where patches ride along).
        square = obs[:, PADDED] ** 2 if dense else obs[:, SUM_SQ]
        x = np.column_stack([obs[:, PADDED], square, np.ones(n)])
        if _independence(x) < config.min_independence:
            continue
        theta = _huber(x, y, config)
        candidates.append((_relative_error(_predict(x, theta), y), dense, theta))
    if not candidates:
        return CostFit(
            model=fixed, state=FitState.ILL_CONDITIONED, fixed_error=fixed_error,
            num_observations=n,
        )  # fmt: skip
    error, dense, (a, b, c) = choose_shape(candidates)
    return CostFit(
        # The patch term is not observed apart from tokens: it keeps its fixed weight.
        model=CostModel(a=1.0, b=b / a, c=c / a, p=fixed.p, dense_rows=dense),
        state=FitState.FITTED,
        seconds=(a, b, c),
        error=error,
        fixed_error=fixed_error,
        num_observations=n,
        errors={("dense" if d else "varlen"): e for e, d, _ in candidates},
    )


def choose_shape(
    candidates: list[tuple[float, bool, tuple[float, float, float]]],
) -> tuple[float, bool, tuple[float, float, float]]:
    """The fit kept among (error, dense, theta) candidates: the smaller error, except that
    varlen must beat dense by VARLEN_MARGIN (ties go to dense, see VARLEN_MARGIN)."""
    by_shape = {dense: cand for cand in candidates for dense in (cand[1],)}
    if len(by_shape) < 2:
        return candidates[0]
    varlen, dense = by_shape[False], by_shape[True]
    return varlen if varlen[0] < VARLEN_MARGIN * dense[0] else dense


def row_feature(config: PlannerConfig) -> RowFeature:
    """The fit's quadratic feature for a job: packed rows follow --attention (auto: learned)."""
    if config.collate is not Collate.PACKED or config.attention is Attention.VARLEN:
        return RowFeature.SAMPLES
    return RowFeature.ROW if config.attention is Attention.DENSE else RowFeature.CHOOSE


def _dense_options(rows: RowFeature) -> tuple[bool, ...]:
    if rows is RowFeature.CHOOSE:
        return (False, True)
    return (rows is RowFeature.ROW,)


def _huber(x: np.ndarray, y: np.ndarray, config: FitConfig) -> tuple[float, float, float]:
    """IRLS with Huber weights, coefficients bounded below (see the module docstring)."""
    n = x.shape[0]
    lower = (A_FLOOR * math.fsum(y) / max(math.fsum(x[:, 0]), 1.0), 0.0, 0.0)
    weights = np.ones(n)
    theta = _solve_bounded(x, y, weights, lower)
    for _ in range(config.iterations):
        residual = y - _predict(x, theta)
        sigma = MAD_TO_SIGMA * float(np.median(np.abs(residual)))
        if sigma <= 0.0:
            break  # an exact fit: nothing left to reweigh
        weights = np.minimum(1.0, HUBER_K * sigma / np.maximum(np.abs(residual), 1e-300))
        theta = _solve_bounded(x, y, weights, lower)
    return theta


def _predict(x: np.ndarray, theta: tuple[float, float, float]) -> np.ndarray:
    # Element-wise products and adds in a fixed order (not a BLAS dot): exact everywhere.
    return x[:, 0] * theta[0] + x[:, 1] * theta[1] + x[:, 2] * theta[2]


def _relative_error(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.median(np.abs(predicted - measured) / measured))


def _scaled_error(predicted: np.ndarray, measured: np.ndarray) -> float:
    """The relative error of `predicted` times its best single factor (median of the ratios)."""
    scale = float(np.median(measured / predicted))
    return _relative_error(predicted * scale, measured)


def _gram(x: np.ndarray, w: np.ndarray, columns: list[int]) -> list[list[float]]:
    return [[math.fsum((w * x[:, i] * x[:, j]).tolist()) for j in columns] for i in columns]


def _independence(x: np.ndarray) -> float:
    """det of the Gram matrix of the columns scaled to unit norm: 1 for orthogonal columns,
    0 when one is a combination of the others (the squared volume they span)."""
    g = _gram(x, np.ones(x.shape[0]), [0, 1, 2])
    d = [math.sqrt(g[i][i]) for i in range(3)]
    if min(d) == 0.0:
        return 0.0
    unit = [[g[i][j] / (d[i] * d[j]) for j in range(3)] for i in range(3)]
    return _det3(unit)


def _det3(m: list[list[float]]) -> float:
    return (
        m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
        - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
        + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
    )


def _solve_bounded(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, lower: tuple[float, float, float]
) -> tuple[float, float, float]:
    """Weighted least squares with theta >= lower: coefficients that fall below their bound
    are held at it and the others refitted (at most 3 passes, fixed order: the same result on
    every daemon)."""
    held: dict[int, float] = {}
    theta = list(lower)
    for _ in range(3):
        free = [j for j in range(3) if j not in held]
        target = y - sum((x[:, j] * v for j, v in sorted(held.items())), np.zeros_like(y))
        solution = _weighted_lstsq(x, target, w, free)
        below = [j for j, v in zip(free, solution, strict=True) if v < lower[j]]
        for j, v in zip(free, solution, strict=True):
            theta[j] = v
        if not below:
            break
        for j in below:
            held[j] = lower[j]
            theta[j] = lower[j]
    return (max(theta[0], lower[0]), max(theta[1], lower[1]), max(theta[2], lower[2]))


def _weighted_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray, free: list[int]) -> list[float]:
    """Solves the weighted normal equations over the `free` columns (Gaussian elimination on
    at most 3x3, columns scaled to unit weighted norm so the pivots are well sized)."""
    if not free:
        return []
    g = _gram(x, w, free)
    rhs = [math.fsum((w * x[:, j] * y).tolist()) for j in free]
    scale = [math.sqrt(g[i][i]) if g[i][i] > 0 else 1.0 for i in range(len(free))]
    k = len(free)
    m = [
        [g[i][j] / (scale[i] * scale[j]) for j in range(k)] + [rhs[i] / scale[i]] for i in range(k)
    ]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            return [0.0] * k  # a column with no weight: no information, lower bounds apply
        for r in range(col + 1, k):
            f = m[r][col] / m[col][col]
            m[r] = [m[r][c] - f * m[col][c] for c in range(k + 1)]
    out = [0.0] * k
    for r in range(k - 1, -1, -1):
        acc = m[r][k] - math.fsum(m[r][c] * out[c] for c in range(r + 1, k))
        out[r] = acc / m[r][r]
    return [out[i] / scale[i] for i in range(k)]
