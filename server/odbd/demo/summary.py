"""The demo's closing table, computed from the trainers' per-step reports (pure)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from odbd.planner.config import CostModel
from odbd.simulate.baselines import fixed_batch_stats
from odbd.simulate.report import summarize


@dataclass(frozen=True, slots=True)
class DemoSummary:
    steps_per_rank: dict[int, int]
    idle_steps: int
    padding_ratio: float
    samples_per_step: float
    identities_covered: int
    dataset_size: int
    duplicates: int  # emitted views beyond the sampler's tail padding
    rejected: dict[str, int]
    simulated_time: float  # cost model, sum over steps of c + max_r work
    fixed_time: float  # fixed batch 4 on the same lengths
    speedup: float


def read_reports(paths: list[Path]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for rank, path in enumerate(paths):
        lines = path.read_text().splitlines() if path.exists() else []
        out[rank] = [json.loads(line) for line in lines if line.strip()]
    return out


def summarize_demo(
    reports: dict[int, list[dict]], lengths: np.ndarray, cost: CostModel, fixed_batch: int = 4
) -> DemoSummary:
    steps = {r: [x for x in recs if "step" in x] for r, recs in reports.items()}
    by_step: dict[tuple[int, int], float] = defaultdict(float)
    real = padded = samples = idle = 0
    ids: list[int] = []
    for recs in steps.values():
        for x in recs:
            group = lengths[np.asarray(x["ids"], dtype=np.int64)] if x["ids"] else lengths[:0]
            work = cost.work(x["padded"], float((group.astype(np.float64) ** 2).sum()))
            key = (x["epoch"], x["step"])
            by_step[key] = max(by_step[key], work)
            real += int(group.sum())
            padded += int(x["padded"])
            samples += len(x["ids"])
            idle += bool(x["idle"])
            ids += x["ids"]
    world = len(reports)
    rejected: dict[str, int] = {}
    for recs in reports.values():
        for x in recs:
            if "epoch_end" in x:
                rejected = {
                    k: int(v) for k, v in x["summary"].get("rejected_by_reason", {}).items()
                }
    num_steps = len(by_step)
    sim_time = num_steps * cost.c + sum(by_step.values())
    fixed = summarize(
        fixed_batch_stats(lengths, world_size=world, batch_size=fixed_batch, cost=cost),
        cost,
        budget=1,
        world_size=world,
    )
    return DemoSummary(
        steps_per_rank={r: len(v) for r, v in steps.items()},
        idle_steps=idle,
        padding_ratio=1 - real / padded if padded else 0.0,
        samples_per_step=samples / num_steps if num_steps else 0.0,
        identities_covered=len(set(ids)),
        dataset_size=int(lengths.shape[0]),
        duplicates=len(ids) - len(set(ids)),
        rejected=rejected,
        simulated_time=sim_time,
        fixed_time=fixed.simulated_time,
        speedup=fixed.simulated_time / sim_time if sim_time else 0.0,
    )


def render(summary: DemoSummary, metrics_urls: list[str], shm_left: list[str]) -> str:
    steps = sorted(set(summary.steps_per_rank.values()))
    rows = [
        (
            "steps per rank",
            ", ".join(f"{s}" for s in steps) + (" (equal)" if len(steps) == 1 else " (UNEQUAL)"),
        ),
        ("idle filler steps", str(summary.idle_steps)),
        ("padding", f"{summary.padding_ratio:.2%}"),
        ("samples per step (global)", f"{summary.samples_per_step:.1f}"),
        ("identity coverage", f"{summary.identities_covered} / {summary.dataset_size}"),
        ("repeated identities", f"{summary.duplicates} (DistributedSampler tail padding)"),
        ("rejected samples", ", ".join(f"{k}={v}" for k, v in summary.rejected.items()) or "none"),
        ("speedup vs fixed batch 4", f"{summary.speedup:.2f}x (cost model, same lengths)"),
        ("/metrics", ", ".join(metrics_urls) or "not served"),
        ("shared memory left", ", ".join(shm_left) or "none"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
