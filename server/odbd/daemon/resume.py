"""A job restarted from --state-dir: the journal is opened (or created) before anything else,
producers wait until every local trainer said where it resumes, and the round loop is rebuilt
from the journal at that point (journal.replay)."""

from __future__ import annotations

import asyncio
import logging

from odbclient.wire.odbd.v1 import (
    trainer_pb2,
)
from odbd.daemon.daemon_state import DaemonState
from odbd.daemon.journal import Journal, check_header, replay
from odbd.errors import ConfigError

log = logging.getLogger("odbd")


class DaemonResume(DaemonState):
    """A restart from --state-dir: the journal opened, the trainers' resume point awaited and
    the round loop restored to it."""

    def _open_journal(self) -> None:
        if self.config.state_dir is None:
            return
        journal = Journal(self.config.state_dir, self.config.node_rank)
        fingerprint = self.config.fingerprint(self.state.dataset_size)
        if journal.exists():
            self.journal_records = journal.records()
            check_header(self.journal_records, fingerprint)
            self.state.paused = True  # producers wait until the trainers say where to resume
            log.info(
                "resuming from %s: waiting for every local trainer's resume point",
                journal.path,
            )
        journal.open(fingerprint, self.state.views_per_iteration)
        self.journal = journal

    def _on_trainer_hello(self, hello: trainer_pb2.TrainerHello) -> str | None:
        if self.journal_records is None or self.resumed:
            return None
        if not hello.resume:
            return (
                f"this daemon restarted from --state-dir {self.config.state_dir}; rank "
                f"{hello.rank} must call ODBClient.load_state_dict() with its checkpoint before "
                "iterating (or start the job afresh with an empty --state-dir)"
            )
        self.resume_points[hello.rank] = (hello.resume_epoch, hello.resume_step)
        self.resume_updates[hello.rank] = hello.resume_update
        if len(self.resume_points) == len(self.queues):
            self.resume_known.set()
        return None

    async def _resume(self) -> None:
        """Waits for every local trainer's resume point, then rebuilds state from the journal."""
        assert self.journal is not None and self.journal_records is not None and self.loop
        try:
            await asyncio.wait_for(self.resume_known.wait(), self.config.join_timeout_s)
        except TimeoutError:
            missing = sorted(set(self.queues) - set(self.resume_points))
            raise ConfigError(
                f"resuming from --state-dir: ranks {missing} sent no resume point within "
                f"{self.config.join_timeout_s:g} s; start their trainers with load_state_dict()"
            ) from None
        points = set(self.resume_points.values())
        if len(points) != 1:
            raise ConfigError(
                f"local trainers resume at different steps {self.resume_points}; every rank "
                "must load the state_dict saved at the same checkpoint step"
            )
        epoch, step = points.pop()
        resume = replay(self.journal_records, self.config.world.world_size, epoch, step)
        self.journal.append_resume(epoch, step)
        self.loop.restore(resume, update=max(self.resume_updates.values(), default=0))
        for queue in self.queues.values():  # the steps before it are not this daemon's to send
            queue.history.floor = (epoch, step)
        self.resumed = True
        self.state.paused = False
        if self.ingest is not None:
            self.ingest.pump_leases()
        log.info(
            "resumed at epoch %d step %d: %d trained steps kept, the rest is produced again",
            epoch,
            step,
            len(resume.trained_steps),
        )
