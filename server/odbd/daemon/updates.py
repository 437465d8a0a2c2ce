"""StepBatch.update of every step the round loop queues: the round's optimizer updates
(planner/windows.py) numbered within their epoch, the same on every daemon."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.metrics.stats import DaemonStats
from odbd.planner.config import PlannerConfig
from odbd.planner.types import NodeRoundPlan

log = logging.getLogger("odbd.round")


class UpdateNumbering:
    """Per epoch, the updates numbered so far; builds each kept step's Update message."""

    def __init__(self, planner: PlannerConfig, stats: DaemonStats) -> None:
        self.planner = planner
        self.stats = stats
        self.in_epoch: Counter[int] = Counter()
        self.short_update_warned = False

    def restore(self, epoch: int, first_update: int) -> None:
        """A restarted job: the trainers' state_dict says which update of `epoch` comes next."""
        self.in_epoch[epoch] = first_update

    def of_round(
        self, plan: NodeRoundPlan, step_epochs: list[int], round_index: int
    ) -> list[trainer_pb2.Update | None]:
        """Each kept step's StepBatch.update (None without windows: the wire stays as before).

        Windows need join mode (DaemonConfig), so a round's steps belong to one epoch and are
        all kept, unless --max-updates cut the round after the job's last update; its updates
        are numbered on from the epoch's previous rounds."""
        if not self.planner.windows or not step_epochs:
            return [None] * len(step_epochs)
        kept = len(step_epochs)
        assert kept <= plan.num_steps, "windows run in join mode only"
        windows, epoch = plan.windows, step_epochs[0]
        first = self.in_epoch[epoch]
        self.in_epoch[epoch] += int((windows.ends <= kept).sum())
        self.stats.epoch_updates = self.in_epoch[epoch]
        self.stats.record_updates(
            (windows.ends - windows.starts).tolist(), windows.num_tokens.tolist()
        )
        self._warn_short_update(plan, round_index)
        out: list[trainer_pb2.Update | None] = []
        for w in range(len(windows)):
            start, end = int(windows.starts[w]), int(windows.ends[w])
            for step in range(start, min(end, kept)):
                out.append(
                    trainer_pb2.Update(
                        index=first + w,
                        end=step == end - 1,
                        num_steps=end - start,
                        step_in_update=step - start,
                        num_tokens=int(windows.num_tokens[w]),
                        num_samples=int(windows.num_samples[w]),
                        short=not bool(windows.closed[w]),
                    )
                )
        return out

    def of_rank(
        self, update: trainer_pb2.Update | None, plan: NodeRoundPlan, step: int, column: int
    ) -> trainer_pb2.Update | None:
        """The Update of the rank in `plan.stats`' `column` at `step`: `update` itself with
        --align steps; with --align updates (planner/update_align.py) the rank's own
        micro-step count, position and end, or skip for a slot after its last micro-step."""
        if update is None or plan.micro_steps is None:
            return update
        w = int(np.searchsorted(plan.windows.ends, step, side="right"))
        start, end = int(plan.windows.starts[w]), int(plan.windows.ends[w])
        mine = int(plan.micro_steps[w, column])
        position = step - start
        out = trainer_pb2.Update()
        out.CopyFrom(update)
        out.per_rank = True
        out.num_steps = mine
        if position >= mine:
            out.skip, out.end, out.step_in_update = True, False, mine
            return out
        out.step_in_update = position
        out.end = position == mine - 1
        out.skipped_after = end - start - mine if out.end else 0
        return out

    def _warn_short_update(self, plan: NodeRoundPlan, round_index: int) -> None:
        """A round that closed no update mid-epoch sends one short update (planner/windows.py);
        warns once, since every such round makes tokens per update uneven."""
        windows = plan.windows
        if plan.final or len(windows) == 0 or windows.closed[-1] or self.short_update_warned:
            return
        self.short_update_warned = True
        log.warning(
            "round %d: its %d steps hold %d loss tokens over every rank, fewer than "
            "--tokens-per-update %d, so they are one short update in the middle of the epoch "
            "(shown once; odbd_update_tokens shows how uneven updates are): raise --buffer so "
            "a round holds several updates' tokens, or lower --tokens-per-update",
            round_index,
            plan.num_steps,
            int(windows.num_tokens.sum()),
            self.planner.tokens_per_update,
        )
