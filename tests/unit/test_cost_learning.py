"""cost_learning.py and the offer codec: every daemon ends up with the same learned model."""

from __future__ import annotations

import numpy as np

from odbd.daemon import offer_codec
from odbd.daemon.cost_learning import MAX_OBSERVATIONS, CostLearner
from odbd.planner.config import CostModel
from odbd.planner.cost_fit import CostModelMode, FitConfig, FitState
from odbd.planner.types import SampleTable, UnitOffer

TRUE = (2e-6, 4e-9, 3e-3)


def timed_steps(learner: CostLearner, rank: int, first_step: int, n: int, seed: int) -> None:
    """Queues n steps of `rank` and reports each one's time, as the trainer would."""
    rng = np.random.default_rng(seed)
    for step in range(first_step, first_step + n):
        lengths = rng.integers(16, 2048, size=int(rng.integers(1, 6))).astype(np.float64)
        padded = int(lengths.max()) * len(lengths)
        sum_sq = float((lengths**2).sum())
        learner.expect(rank, 0, step, padded, sum_sq)
        seconds = (TRUE[0] * padded + TRUE[1] * sum_sq + TRUE[2]) * (1 + 0.02 * rng.normal())
        learner.measured(rank, 0, step, seconds)


def exchange(learners: list[CostLearner]) -> list[np.ndarray]:
    """One round: each node's offer carries its new observations, through the real codec."""
    payloads = []
    for node, learner in enumerate(learners):
        offer = offer_codec.NodeOffer(
            node=node, epoch=0, units=(), rejected={}, observations=learner.take_new()
        )
        payloads.append(offer_codec.encode(offer))
    return [offer_codec.decode(p).observations for p in payloads]


def test_daemons_with_different_local_reports_fit_identical_models() -> None:
    config = FitConfig(warmup=64, window=256)
    learners = [CostLearner(CostModelMode.AUTO, CostModel(), config) for _ in range(2)]
    fits = []
    for round_index in range(8):
        for node, learner in enumerate(learners):
            timed_steps(
                learner, rank=node, first_step=20 * round_index, n=20, seed=round_index + 7 * node
            )
        observations = exchange(learners)
        fits = [learner.absorb(observations) for learner in learners]
        assert fits[0] == fits[1] or (
            fits[0].state is FitState.WARMUP and fits[1].state is FitState.WARMUP
        )
        assert learners[0].model == learners[1].model
    assert fits[0].state is FitState.FITTED and learners[0].learned
    assert abs(learners[0].model.b / (TRUE[1] / TRUE[0]) - 1) < 0.1


def test_fixed_mode_fits_for_the_metrics_but_plans_with_the_fixed_model() -> None:
    learner = CostLearner(CostModelMode.FIXED, CostModel(), FitConfig(warmup=32, window=64))
    timed_steps(learner, rank=0, first_step=0, n=40, seed=1)
    learner.absorb([learner.take_new()])
    assert learner.fit.state is FitState.FITTED
    assert not learner.learned and learner.model == CostModel()


def test_unexpected_idle_and_unknown_steps_are_not_observations() -> None:
    learner = CostLearner(CostModelMode.AUTO, CostModel(), FitConfig())
    learner.expect(0, 0, 0, 0, 0.0)  # an idle filler
    learner.measured(0, 0, 0, 0.1)
    learner.measured(0, 0, 99, 0.1)  # never queued here (before a restart)
    learner.expect(0, 0, 1, 100, 1e4)
    learner.measured(0, 0, 1, 0.0)  # a clock glitch
    assert learner.take_new().shape == (0, 3)


def test_an_offer_carries_at_most_the_newest_observations() -> None:
    learner = CostLearner(CostModelMode.AUTO, CostModel(), FitConfig())
    timed_steps(learner, rank=0, first_step=0, n=MAX_OBSERVATIONS + 10, seed=2)
    taken = learner.take_new()
    assert taken.shape == (MAX_OBSERVATIONS, 3)
    assert learner.take_new().shape == (0, 3)


def test_the_codec_carries_observations_bit_exactly_beside_the_units() -> None:
    observations = np.array([[100.0, 1e4 / 3, 0.1 + 0.2], [7.0, np.pi, 1e-9]])
    unit = UnitOffer(0, SampleTable.of([3, 4], [10, 20]), dry=False)
    offer = offer_codec.NodeOffer(
        node=1, epoch=2, units=(unit,), rejected={"x": 1}, observations=observations
    )
    back = offer_codec.decode(offer_codec.encode(offer))
    assert back.observations.tobytes() == observations.tobytes()
    assert back.units[0].samples.lengths.tolist() == [10, 20]
