"""Optimizer updates of a simulated plan (--accumulate / --tokens-per-update), so a user can
pick T offline: updates per epoch, micro-steps and tokens per update, and how evenly sized the
updates are (coefficient of variation of tokens per update, the epoch's last update excluded,
since only it may be short)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from odbd.planner.epoch import SimulationResult

# Quantiles shown for the tokens-per-update distribution (a histogram in one line).
_QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)


@dataclass(frozen=True, slots=True)
class UpdateSummary:
    updates_per_epoch: tuple[int, ...]
    micro_steps: tuple[int, ...]  # per update, in plan order
    tokens: tuple[int, ...]  # loss-bearing tokens per update, every rank
    samples: tuple[int, ...]
    epoch_last: tuple[bool, ...]  # per update: the last of its epoch

    def tokens_cv(self) -> float:
        """Coefficient of variation of tokens per update, each epoch's last update excluded."""
        full = [t for t, last in zip(self.tokens, self.epoch_last, strict=True) if not last]
        if len(full) < 2 or statistics.fmean(full) == 0:
            return 0.0
        return statistics.pstdev(full) / statistics.fmean(full)

    def as_json(self) -> dict[str, Any]:
        tokens = np.asarray(self.tokens, dtype=np.float64)
        quantiles = np.quantile(tokens, _QUANTILES).tolist() if tokens.size else []
        return {
            "updates": len(self.tokens),
            "updates_per_epoch": list(self.updates_per_epoch),
            "micro_steps_per_update": _spread(self.micro_steps),
            "tokens_per_update": {**_spread(self.tokens), "cv_except_last": self.tokens_cv()},
            "tokens_per_update_quantiles": dict(zip(map(str, _QUANTILES), quantiles, strict=True)),
            "samples_per_update": _spread(self.samples),
        }


def summarize_updates(result: SimulationResult) -> UpdateSummary:
    """Join-mode plans: every round's steps are kept and belong to one epoch."""
    per_epoch: dict[int, int] = {}
    steps: list[int] = []
    tokens: list[int] = []
    samples: list[int] = []
    epochs: list[int] = []
    position = 0
    for plan, kept in zip(result.rounds, result.steps_kept, strict=True):
        if kept == 0:
            continue
        epoch = int(result.step_epoch[position])
        position += kept
        w = plan.windows
        per_epoch[epoch] = per_epoch.get(epoch, 0) + len(w)
        steps += (w.ends - w.starts).tolist()
        tokens += w.num_tokens.tolist()
        samples += w.num_samples.tolist()
        epochs += [epoch] * len(w)
    last = [i + 1 == len(epochs) or epochs[i + 1] != e for i, e in enumerate(epochs)]
    return UpdateSummary(
        updates_per_epoch=tuple(per_epoch[e] for e in sorted(per_epoch)),
        micro_steps=tuple(steps),
        tokens=tuple(tokens),
        samples=tuple(samples),
        epoch_last=tuple(last),
    )


def render_updates(summary: UpdateSummary) -> str:
    j = summary.as_json()
    st, tk, sa = j["micro_steps_per_update"], j["tokens_per_update"], j["samples_per_update"]
    q = j["tokens_per_update_quantiles"]
    return "\n".join(
        [
            f"optimizer updates: {j['updates']:,} ({', '.join(map(str, j['updates_per_epoch']))} "
            "per epoch)",
            f"  micro-steps per update: mean {st['mean']:.2f}, min {st['min']}, max {st['max']}",
            f"  tokens per update: mean {tk['mean']:,.0f}, cv {100 * tk['cv_except_last']:.2f} % "
            f"(each epoch's last update excluded); p0 {q['0.0']:,.0f} p10 {q['0.1']:,.0f} "
            f"p50 {q['0.5']:,.0f} p90 {q['0.9']:,.0f} p100 {q['1.0']:,.0f}",
            f"  samples per update: mean {sa['mean']:.1f}, min {sa['min']}, max {sa['max']}",
        ]
    )


def _spread(values: tuple[int, ...]) -> dict[str, Any]:
    if not values:
        return {"mean": 0.0, "min": 0, "max": 0}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
