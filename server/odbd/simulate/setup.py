"""The validated `odbd simulate` request (command.py builds it, runner.py runs it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from odbd.planner.config import PlannerConfig
from odbd.planner.migration import LinkModel


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """A validated simulation request."""

    lengths: np.ndarray  # (N,) int64; sample id = index
    patches: np.ndarray | None  # (N,) int64 vision patches (--lengths' second column)
    source: str  # where the lengths came from, for the table header
    config: PlannerConfig
    epochs: int
    join: bool
    compare_batch_sizes: tuple[int, ...]  # empty = no --compare
    as_json: bool
    plan_out: str | None
    planning_time: bool = False  # report per-daemon planning time and payload bytes
    migration: LinkModel | None = None  # --migrate auto: planner/migration.py's link model
    # --migrate-decision: digest (the live daemons' decision, migration_digest.py) or pooled
    digest: bool = True
