"""How epochs and the job end, as the round loop sees them: an epoch's tally ends in its
EpochEnd (or a failure, when it emitted nothing), the job ends by its epochs, its sample quota,
--max-updates, every rank's ODBClient.end_job() point (end_requests.py decides what they mean)
or a failure (peer lost, SIGTERM), and the trainers learn each through their queues."""

from __future__ import annotations

import asyncio
import logging
import time

from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.daemon.end_requests import (
    EndDecision,
    EndOutcome,
    Point,
    end_decision,
    missing_failure,
)
from odbd.daemon.round_base import RoundLoopState
from odbd.daemon.trained import steps_trained
from odbd.ingest.rejections import (
    empty_epoch_failure,
    epoch_rejection_summary,
)
from odbd.planner.identities import StepIdentities
from odbd.planner.types import NodeRoundPlan
from odbd.serve.rank_queue import QueuedItem

log = logging.getLogger("odbd.round")


_TELL_FAILURE_S = 60.0  # a failed job waits this long for unattached trainers to learn why


class RoundEnding(RoundLoopState):
    """Epochs and the job end: the tallies' epoch ends, ODBClient.end_job() points, failures."""

    def _advance_epochs(
        self, plan: NodeRoundPlan, step_epochs: list[int], emitted: StepIdentities
    ) -> None:
        """Counts the kept steps into their epochs' tallies and ends the epochs they finish.
        `emitted`: every node's identities per step (the hub's sum), folded into each step's
        own epoch (a --no-join round may end one epoch and start the next)."""
        if self.config.join:
            self.tally.steps += len(step_epochs)
            self.tally.samples += int(plan.global_num_samples[: len(step_epochs)].sum())
            for i in range(len(step_epochs)):
                self.tally.identities.fold(*emitted.of_step(i))
            if plan.final and len(step_epochs) == plan.num_steps:  # not cut by --max-updates
                self._end_epoch(self.state.epoch)
                self.state.epoch += 1
                if self.config.epochs and self.state.epoch >= self.config.epochs:
                    self._end_job("all epochs done")
            return
        for i, epoch in enumerate(step_epochs):
            if epoch > self.state.epoch:
                self._end_epoch(self.state.epoch)
                self.state.epoch = epoch
            self.tally.steps += 1
            self.tally.samples += int(plan.global_num_samples[i])
            self.tally.identities.fold(*emitted.of_step(i))
        n = self.state.dataset_size
        if self.capped and n and self.quota_consumed >= (self.state.epoch + 1) * n:
            self._end_epoch(self.state.epoch)  # the job's last update ends this epoch too
        quota = self.config.epochs * self.state.dataset_size
        if self.config.epochs and self.quota_consumed >= quota:
            self._end_epoch(self.state.epoch)
            self._end_job("sample quota reached")

    def _end_epoch(self, epoch: int) -> None:
        tally = self.tally
        assert tally.rejected is not None
        if tally.samples == 0:
            # Decided from global facts (every node's offers), so every daemon fails alike; the
            # trainers get the failed JobEnd instead of an empty epoch.
            self.failure = empty_epoch_failure(epoch, tally.rejected, self.state.first_rejection)
            self._end_job(self.failure, failed=True)
            return
        end = trainer_pb2.EpochEnd(
            epoch=epoch,
            num_steps=tally.steps,
            global_num_samples=tally.samples,
            rejected_by_reason=dict(tally.rejected),
            num_identities=tally.num_seen,
        )
        if tally.rejected:
            log.warning(
                "%s; the job goes on (at most --max-reject-fraction %g of an epoch may be "
                "rejected); the first of each reason was logged when it happened",
                epoch_rejection_summary(epoch, tally.rejected, self.state.dataset_size),
                self.config.max_reject_fraction,
            )
        # Planned, not trained: the queues hold up to --steps-ahead of its steps (a small epoch
        # is planned whole at start-up). "epoch N trained" follows when the trainers took it.
        taken = steps_trained(epoch, [q.trained for q in self.queues.values()])
        log.info(
            "epoch %d planned: %d steps, %d samples, %d identities of %d, rejected %s; "
            "trained so far: %s",
            epoch,
            tally.steps,
            tally.samples,
            end.num_identities,
            self.state.dataset_size,
            dict(tally.rejected) or "none",
            "every step" if taken is None else f"{taken} of its {tally.steps} steps",
        )
        for queue in self.queues.values():
            queue.push([QueuedItem(epoch, -1, trainer_pb2.TrainerEvent(epoch_end=end))])
        self.stats.epoch_samples, self.stats.epoch_identities = tally.samples, end.num_identities
        self.tally = self._new_tally()
        self.stats.epochs_done += 1

    def _end_job(self, reason: str, failed: bool = False) -> None:
        if self.done:
            return  # a failure ended it already (then "all epochs done" follows)
        self.done = True
        end = trainer_pb2.JobEnd(reason=reason, failed=failed)
        for queue in self.queues.values():
            queue.push([QueuedItem(self.state.epoch, -1, trainer_pb2.TrainerEvent(job_end=end))])

    # -- ODBClient.end_job() ------------------------------------------------------------------

    def request_end(self, rank: int, epoch: int, step: int) -> None:
        """A local rank called end_job() before (epoch, step): it takes nothing from there on
        (its queue drops those steps now), and its point goes to every node with the next
        round, offered at once. Once every round is planned (`done`), no round can carry it:
        this node's own ranks decide for it alone."""
        if rank in self.end_points_local or self.failure is not None:
            return  # end_job() twice: the client sends it once; a resent one changes nothing
        point = self._normalized((epoch, step))
        self.end_points_local[rank] = point
        if self.end_first_s is None:
            self.end_first_s = time.monotonic()
        self.free(self.queues[rank].end_at(*point))
        log.info("rank %d called end_job() at epoch %d step %d", rank, *point)
        if self.done:
            self._decide_end(end_decision(self.queues, self.end_points_local), local=True)
            return
        self._end_unsent = True
        self.progress.set()

    def _normalized(self, point: Point) -> Point:
        """(e, n) with n the final step count of epoch e is (e + 1, 0): a rank that left its
        loop before taking the epoch's end trained the same steps as one that took it."""
        epoch, step = point
        if epoch < self.state.epoch and step >= self.steps_in_epoch[epoch]:
            return epoch + 1, 0
        return point

    @property
    def ending(self) -> bool:
        """A rank called end_job() (here, or on another node as far as rounds told)."""
        return bool(self.end_points_local or self.end_requests)

    def ending_status(self, now_s: float) -> str:
        """`odbd status`'s ending line: who called end_job() where, who the job waits for (as
        far as rounds told this node; once every round is planned, this node's ranks only) and
        the time left before --end-timeout fails it. "" while no rank called it."""
        if self.end_first_s is None:
            return ""
        requests = {**self.end_requests, **self.end_points_local}
        world = self.state.planner.world
        ranks = sorted(self.queues) if self.done else list(range(world.world_size))
        by_point: dict[Point, list[int]] = {}
        for rank, point in sorted(requests.items()):
            by_point.setdefault(point, []).append(rank)
        called = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} at epoch {e} step {s}"
            for (e, s), rs in sorted(by_point.items())
        )
        waiting = [r for r in ranks if r not in requests]
        if not waiting:
            return f"end_job() called by every rank ({called}): the job ends there"
        left = max(self.config.end_timeout_s - (now_s - self.end_first_s), 0.0)
        return (
            f"end_job() called by {called}; waiting for rank{'s' if len(waiting) > 1 else ''} "
            f"{','.join(map(str, waiting))} (the job fails in {left:.0f} s, --end-timeout "
            f"{self.config.end_timeout_s:g} s)"
        )

    def _local_end_points(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((r, e, s) for r, (e, s) in sorted(self.end_points_local.items()))

    def _ends_by_request(self, ended: tuple[tuple[int, int, int], ...]) -> bool:
        """Merges every node's end_job() points (the hub's list in node order, the same on
        every daemon after a round); True once they end the job here."""
        for rank, epoch, step in ended:
            self.end_requests.setdefault(rank, (epoch, step))
        if self.end_requests and self.end_first_s is None:
            self.end_first_s = time.monotonic()
        world = range(self.state.planner.world.world_size)
        return self._decide_end(end_decision(world, self.end_requests), local=False)

    def _decide_end(self, decision: EndDecision, *, local: bool) -> bool:
        if decision.outcome is EndOutcome.FAIL:
            self.failure = decision.reason
            self.abort(decision.reason)
            return True
        if decision.outcome is not EndOutcome.END or local:
            return False  # local (every round planned): the queued job's end follows as is
        assert decision.point is not None
        for queue in self.queues.values():
            self.free(queue.end_at(*decision.point))
        log.info("%s: the job ends there; steps planned after it are dropped", decision.reason)
        self._end_job(decision.reason)
        return True

    def end_overdue(self, now_s: float) -> str | None:
        """The failure once --end-timeout passed since the first end_job() point heard of
        with some rank's point still unknown (every rank's, or this node's own once no round
        can carry points any more); None otherwise."""
        if self.end_first_s is None or self.failure is not None:
            return None
        if now_s - self.end_first_s < self.config.end_timeout_s:
            return None
        world = self.state.planner.world
        ranks = self.queues if self.done else range(world.world_size)
        requests = {**self.end_requests, **self.end_points_local}
        if self.done:
            requests = {r: p for r, p in requests.items() if r in self.queues}
        if end_decision(ranks, requests).outcome is not EndOutcome.WAIT:
            return None
        nodes = {r: r // world.ranks_per_node for r in range(world.world_size)}
        return missing_failure(ranks, requests, self.config.end_timeout_s, nodes)

    def give_up(self, reason: str) -> None:
        """This node cannot make samples any more: the job fails at once (peers see it go)."""
        self.fatal = reason
        self.progress.set()

    async def _tell_trainers(self) -> None:
        """A job can fail before its trainers attach (every sample rejected in seconds): wait,
        bounded, until each local rank connected once, so it raises JobFailedError with the
        reason rather than finding no daemon. Ranks still attached are drained by the daemon."""
        deadline = time.monotonic() + _TELL_FAILURE_S
        while missing := [r for r, q in self.queues.items() if not q.ever_attached]:
            if time.monotonic() > deadline:
                log.warning("ranks %s never attached to learn that the job failed", missing)
                return
            await asyncio.sleep(0.05)

    def fail(self, reason: str) -> None:
        """The job stops (SIGTERM): trainers take what is queued, then learn why."""
        self._end_job(reason, failed=True)

    def abort(self, reason: str) -> None:
        """The job cannot go on (peer lost, round timeout): trainers learn it next.

        Steps not yet sent are dropped: the dead node's ranks will never run them, so a
        trainer that kept training would hang in its next DDP collective instead.
        """
        if not self.done:
            for queue in self.queues.values():
                queue.drop_unsent()
            self._end_job(reason, failed=True)
