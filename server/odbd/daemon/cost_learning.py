"""--cost-model auto: gathers timed rank-steps and keeps every daemon's fit identical.

Trainers report their own step times only to their node's daemon, so a model fitted from local
reports would differ between daemons, and so would their plans. Instead:

1. when a local step is queued, `expect` remembers its padded tokens and sum of squared
   lengths; when its trainer reports the step's time (`measured`), that becomes an observation
2. each offer carries this node's new observations (`take_new`, at most MAX_OBSERVATIONS, the
   newest: ~1.5 KiB per round)
3. after the exchange every daemon appends every node's observations, in node order, to the
   same window and fits it (`absorb`): the same inputs, the same deterministic fit
   (planner/cost_fit.py), so the same coefficients plan the round on every daemon

A restarted job starts with an empty window on every daemon (a lost daemon fails the whole job,
so they all restart) and warms up again, with the fixed model meanwhile.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from odbd.planner.config import CostModel
from odbd.planner.cost_fit import (
    CostFit,
    CostModelMode,
    FitConfig,
    FitState,
    RowFeature,
    fit_cost_model,
)

MAX_OBSERVATIONS = 64  # per node per round: the newest; older unsent ones are dropped
MAX_EXPECTED = 1 << 14  # queued steps remembered per node, oldest forgotten first
# Refit once this many new observations arrived since the last fit: a fit of the full window
# costs ~8 ms on this machine, on the round's critical path, so not every round pays it.
REFIT_EVERY = 32


class CostLearner:
    """One daemon's side of the learned cost model (its state is the same on every daemon
    except `_expected` and `_new`, which only feed this node's offers)."""

    def __init__(
        self,
        mode: CostModelMode,
        fixed: CostModel,
        config: FitConfig,
        rows: RowFeature = RowFeature.SAMPLES,
    ) -> None:
        self.mode = mode
        self.fixed = fixed
        self.config = config
        self.rows = rows  # the fit's quadratic feature (cost_fit.row_feature)
        self.fit = CostFit(model=fixed, state=FitState.WARMUP)
        self._expected: OrderedDict[tuple[int, int, int], tuple[float, float]] = OrderedDict()
        self._new: list[tuple[float, float, float]] = []
        self._window = np.zeros((0, 3))
        self._since_fit = 0

    @property
    def model(self) -> CostModel:
        """What the planner uses now: the fit once it is usable under auto, else the fixed."""
        return self.fit.model if self.learned else self.fixed

    @property
    def learned(self) -> bool:
        return self.mode is CostModelMode.AUTO and self.fit.state is FitState.FITTED

    def expect(self, rank: int, epoch: int, step: int, padded: float, sum_sq: float) -> None:
        """A local rank-step was queued with these features (idle fillers are not expected);
        `padded` counts its linear work: padded tokens plus p x its vision patches."""
        if padded <= 0:
            return
        self._expected[(rank, epoch, step)] = (float(padded), sum_sq)
        while len(self._expected) > MAX_EXPECTED:
            self._expected.popitem(last=False)

    def measured(self, rank: int, epoch: int, step: int, seconds: float) -> None:
        """The rank's trainer timed that step (ODBClient.report_compute)."""
        features = self._expected.pop((rank, epoch, step), None)
        if features is None or not seconds > 0.0:
            return  # an idle filler, a step of before a restart, or a clock glitch
        self._new.append((*features, float(seconds)))

    def take_new(self) -> np.ndarray:
        """This node's observations for its next offer, (m, 3) float64."""
        rows = self._new[-MAX_OBSERVATIONS:]
        self._new = []
        return np.asarray(rows, dtype=np.float64).reshape(-1, 3)

    def absorb(self, per_node: Sequence[np.ndarray]) -> CostFit:
        """Every node's observations of one round, in node order; refits when due."""
        added = sum(int(o.shape[0]) for o in per_node)
        if added:
            window = np.concatenate([self._window, *per_node])
            self._window = window[-self.config.window :]
            self._since_fit += added
        warm = self._window.shape[0] >= self.config.warmup
        first = self.fit.state is FitState.WARMUP and warm
        if first or (warm and self._since_fit >= REFIT_EVERY):
            self.fit = fit_cost_model(self._window, self.fixed, self.config, self.rows)
            self._since_fit = 0
        elif self.fit.state is FitState.WARMUP:
            self.fit = CostFit(
                model=self.fixed, state=FitState.WARMUP, num_observations=len(self._window)
            )
        return self.fit
