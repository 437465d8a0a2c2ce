"""Summary numbers of a simulated run (DESIGN.md section 4), as a table and as JSON.

One `summarize` serves the planner and every baseline: all of them produce StepStats of shape
(steps, W). Times are in the cost model's token-equivalents.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from odbd.planner.config import CostModel
from odbd.planner.types import StepStats


@dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    """One run under the cost model; the keys of `--json`."""

    steps: int  # steps per rank (every rank runs the same number)
    padding_ratio: float  # 1 - real / padded tokens
    samples_per_step: float  # global samples (all ranks) per step
    imbalance: float  # sum_k max_r work / sum_k mean_r work; 1.0 = perfectly even steps
    efficiency: float  # ideal_time / simulated_time; 1.0 = the bound
    simulated_time: float  # sum_k (c + max_r work[k, r])
    ideal_time: float  # steps_min * c + (a * sum l + b * sum l^2) / W

    def as_json(self) -> dict[str, int | float]:
        return asdict(self)


def summarize(stats: StepStats, cost: CostModel, budget: int, world_size: int) -> Summary:
    """Summary of a run's StepStats (shape (steps, W)) under `cost` with token budget `budget`.

    `work` excludes the per-step constant c, so `imbalance` compares only the part of a step
    that differs between ranks (with c included every ratio would drift toward 1).
    The ideal bound uses the sum of lengths and of squared lengths of the samples actually
    emitted, so it and the simulated time count the same tokens (tail-padding views included).
    """
    num_steps = int(stats.work.shape[0])
    real = float(stats.real_tokens.sum())
    padded = float(stats.padded_tokens.sum())
    step_max = stats.work.max(axis=1, initial=0.0)
    step_mean = stats.work.mean(axis=1) if world_size else np.zeros(num_steps)
    simulated = float(num_steps * cost.c + step_max.sum())
    # work = a * padded + b * sum l^2, so b * sum l^2 needs no division by b (which may be 0).
    quadratic = float(np.maximum(stats.work - cost.a * stats.padded_tokens, 0.0).sum())
    steps_min = real / (world_size * budget)
    ideal = steps_min * cost.c + (cost.a * real + quadratic) / world_size
    return Summary(
        steps=num_steps,
        padding_ratio=_ratio(padded - real, padded, empty=0.0),
        samples_per_step=_ratio(float(stats.num_samples.sum()), num_steps, empty=0.0),
        imbalance=_ratio(float(step_max.sum()), float(step_mean.sum()), empty=1.0),
        efficiency=_ratio(ideal, simulated, empty=1.0),
        simulated_time=simulated,
        ideal_time=ideal,
    )


def _ratio(numerator: float, denominator: float, *, empty: float) -> float:
    return numerator / denominator if denominator > 0 else empty


@dataclass(frozen=True, slots=True)
class Freshness:
    """How many groups of a later epoch an earlier one already formed (same sample ids)."""

    repeated: int  # groups of epoch e > 0 with >= 2 samples that epoch e - 1 also formed
    groups: int  # groups of epochs e > 0 with >= 2 samples (a lone sample cannot vary)

    def as_json(self) -> dict[str, int]:
        return {"repeated": self.repeated, "groups": self.groups}


def repeated_groups(steps: Iterable[tuple[int, int, list[list[tuple[int, int]]]]]) -> Freshness:
    """Freshness of a plan given as SimulationResult.iter_steps() (epoch, step, ranks)."""
    by_epoch: dict[int, set[frozenset[int]]] = {}
    for epoch, _, ranks in steps:
        formed = by_epoch.setdefault(epoch, set())
        formed.update(frozenset(i for i, _ in rank) for rank in ranks if len(rank) > 1)
    num_repeated = num_groups = 0
    for epoch, formed in by_epoch.items():
        if epoch - 1 in by_epoch:
            num_repeated += len(formed & by_epoch[epoch - 1])
            num_groups += len(formed)
    return Freshness(num_repeated, num_groups)


def render_freshness(freshness: Freshness) -> str:
    share = _ratio(freshness.repeated, freshness.groups, empty=0.0)
    return (
        f"groups repeated across epochs: {freshness.repeated:,} of {freshness.groups:,} "
        f"({100 * share:.1f} %) multi-sample groups of an epoch were already formed by the last"
    )


def report_json(ours: Summary, baselines: Mapping[str, Summary]) -> dict[str, Any]:
    """The `--json` object: our keys, plus {"baselines": {name: same keys}}."""
    out: dict[str, Any] = dict(ours.as_json())
    out["baselines"] = {name: summary.as_json() for name, summary in baselines.items()}
    return out


_COLUMNS = (
    ("run", "<"),
    ("steps", ">"),
    ("padding %", ">"),
    ("samples/step", ">"),
    ("imbalance", ">"),
    ("efficiency", ">"),
    ("simulated time", ">"),
    ("ours vs it", ">"),
)


def render_table(ours: tuple[str, Summary], baselines: Sequence[tuple[str, Summary]]) -> str:
    """A fixed-width table: our run first, then each baseline with the speedup of ours over it
    (baseline simulated time / ours; > 1 means ours is faster)."""
    reference = ours[1].simulated_time
    rows = [_row(name, summary, reference) for name, summary in (ours, *baselines)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, (h, _) in enumerate(_COLUMNS)]
    lines = [_line([h for h, _ in _COLUMNS], widths), _line(["-" * w for w in widths], widths)]
    lines += [_line(row, widths) for row in rows]
    return "\n".join(lines)


def _row(name: str, s: Summary, reference: float) -> list[str]:
    speedup = _ratio(s.simulated_time, reference, empty=1.0)
    return [
        name,
        f"{s.steps:,}",
        f"{100 * s.padding_ratio:.2f}",
        f"{s.samples_per_step:.1f}",
        f"{s.imbalance:.3f}",
        f"{s.efficiency:.3f}",
        f"{s.simulated_time:,.0f}",
        f"{speedup:.2f}x",
    ]


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    parts = [
        f"{cell:{align}{width}}"
        for cell, width, (_, align) in zip(cells, widths, _COLUMNS, strict=True)
    ]
    return "  ".join(parts).rstrip()
