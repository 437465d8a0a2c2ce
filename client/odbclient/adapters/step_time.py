"""What the adapters report as a rank's own compute per step (`ODBClient.report_compute`).

`--cost-model auto` fits the planner's cost to these reports, so they must time the rank's own
work and never a wait for another rank: under DDP the backward pass ends with the gradient
all-reduce, where every rank waits for the slowest, so its time says more about the other
ranks' batches than about this one's. What a framework loop lets an adapter time without waits:

- the forward pass (no collective: DDP's buffer broadcast is a few bytes),
- the backward pass when it all-reduces nothing: one process, or a micro-step under no_sync,
- the optimizer step after the all-reduce (local work), which every step pays: the per-step
  constant the planner weighs against more, shorter rows (issue 27).

Where the backward pass includes the all-reduce, it is counted as BACKWARD_PER_FORWARD times
the forward (backward computes the gradients of activations and of weights, two matmuls per
forward matmul: the usual 2x of transformer FLOP counts). Only the ratios of the fitted
coefficients reach the planner, so a uniform error in that factor changes nothing but how the
optimizer's constant weighs against the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

BACKWARD_PER_FORWARD = 2.0


def own_clock(device: torch.device) -> float:
    """perf_counter after this rank's queued device work (CUDA runs asynchronously): a
    synchronize waits for this GPU only, never for another rank."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass(frozen=True, slots=True)
class StepTime:
    """One step's timed parts, in seconds; backward is None where it included waits."""

    forward: float
    backward: float | None
    optimizer: float = 0.0

    @property
    def own_seconds(self) -> float:
        backward = (
            self.backward if self.backward is not None else BACKWARD_PER_FORWARD * self.forward
        )
        return self.forward + backward + self.optimizer
