"""How the daemon's parts reach each other once running: the callbacks start-up hands to the
ingest service, the trainer service and the producer supervisor, which pass their events on
to the round loop, the stats and the log."""

from __future__ import annotations

import logging
import time

import numpy as np

from odbclient.shm import Allocation
from odbclient.wire.odbd.v1 import (
    trainer_pb2,
)
from odbd.daemon.daemon_state import DaemonState
from odbd.daemon.node_commits import Rejected
from odbd.ingest.lanes import Lanes

log = logging.getLogger("odbd")


class DaemonCallbacks(DaemonState):
    """The events the parts report, passed on: trainers' reports and end_job() calls, ingest
    progress and rejections, producer restarts, shared memory given back."""

    def _on_end_job(self, rank: int, end: trainer_pb2.EndJob) -> None:
        if self.loop is not None:
            self.loop.request_end(rank, end.epoch, end.step)

    def _on_producer_restart(self) -> None:
        self.stats.producers_restarted += 1

    def _on_delivered(self, rank: int, delivered: trainer_pb2.Delivered) -> None:
        rank_stats = self.stats.rank(rank)
        rank_stats.wait_s += delivered.wait_s
        rank_stats.compute_s += delivered.compute_s
        rank_stats.delivered_steps += max(delivered.steps, 1)
        took_s = delivered.wait_s + delivered.compute_s
        for line in self.stats.trained.on_report(time.monotonic(), took_s):
            log.info("%s", line)
        if self.loop is not None:
            for timed in delivered.measured:
                self.loop.cost.measured(rank, timed.epoch, timed.step, timed.compute_s)
            self.loop.trainer_progress()

    def _on_progress(self) -> None:
        if self.loop is not None:
            self.loop.ingest_progress()

    def _on_ingest_error(self, message: str) -> None:
        self.last_error = message  # e.g. a producer refused for its dataset size

    def _on_rejected(self, rejected: Rejected) -> None:
        in_full, summary = self._rejection_log.record(rejected.reason, time.monotonic())
        if in_full:
            log.warning(
                "rejected sample %d (view %d): %s: %s (further %s rejections are counted, "
                "summarised every %.0f s and at epoch end)",
                rejected.identity,
                rejected.view_key,
                rejected.reason,
                rejected.detail,
                rejected.reason,
                self._rejection_log.interval_s,
            )
        if summary:
            log.warning("rejected since the last summary: %s", summary)
        self.rejections.append(rejected)
        self.stats.rejected[rejected.reason] += 1

    def _free(self, lanes: Lanes, locations: list) -> None:
        if locations and self.ingest is not None:
            self.ingest.give_back(lanes.free(locations))
            self.ingest.pump_leases()
        if locations and self.loop is not None:
            self.loop.trainer_progress()

    def _release_held(self, trained_elsewhere: np.ndarray) -> None:
        """Round 0's moves exchange named every view the other nodes trained before the
        resume point: the views this node held back since its restart are settled."""
        held = self.state.num_held()
        final, again = self.state.release_held(trained_elsewhere)
        if held:
            log.info(
                "restart with moves: of %d views this node had moved out and not trained, "
                "%d were trained by other nodes (final) and %d are produced again",
                held, final, again,
            )  # fmt: skip
        if again and self.ingest is not None:
            self.ingest.pump_leases()

    def _read_sample(self, segment: int, offset: int, nbytes: int) -> memoryview:
        assert self.arena is not None
        name = self.arena.segment_names[segment]
        return self.arena.view(Allocation(name, offset, nbytes))
