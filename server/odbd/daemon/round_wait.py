"""Step 1 of a round: wait until this node is ready to offer it (every local unit has a full
buffer or is dry, and the trainers have at most --steps-ahead steps queued), and say why it
is not (the periodic wait line, `odbd status`, the hub's report of a waiting node)."""

from __future__ import annotations

import asyncio
import logging
import time

from odbd.daemon.round_base import JobFailed
from odbd.daemon.round_ending import RoundEnding
from odbd.daemon.split_exchange import barrier_round
from odbd.serve.rank_queue import RankQueue

log = logging.getLogger("odbd.round")


_WAIT_LOG_S = 10.0


def wait_reason(
    *,
    producers: int,
    buffered: int,
    rejected: dict[str, int],
    lanes_full: bool,
    starting: tuple[int, float] = (0, 0.0),
    slow: tuple[str, int, float] | None = None,
    held_by_ranks: bool = False,
) -> str:
    """Why nothing arrives, as far as this node can tell, for the periodic wait line.

    `slow`: (producer, identity, seconds) of the sample a producer has been making longest,
    once past SLOW_SAMPLE_S (a 60 s dataset[i] read as "making samples" before).
    `held_by_ranks`: ranks sit on undelivered steps (named before this reason by the caller).
    `starting`: the --workers processes alive and seconds since the first started. With none
    attached they are still in the dataset factory (it runs in every worker before it
    connects), which can take minutes for a real dataset: telling the operator to start
    producers by hand then sent them the wrong way (found with a 45 s factory)."""
    workers, since_s = starting
    if producers == 0 and workers > 0:
        return (
            f"no producer is attached yet: {workers} --workers process"
            f"{'es' if workers > 1 else ''} started {since_s:.0f} s ago and "
            f"{'have' if workers > 1 else 'has'} not connected; each builds the dataset "
            "(the --dataset factory runs in every worker) before it connects, so a slow "
            "factory shows here and the round starts once one connects; if it never does, "
            "run the worker's command (ps shows it) by hand to see where it stops"
        )
    if producers == 0:
        return (
            "no producer is attached: start producers on this node (python -m "
            "odbclient.producer.producer_main --socket ...), or see above why --workers stopped"
        )
    if lanes_full and held_by_ranks:  # the ranks named first hold the space: not a size issue
        return "every producer waits for lane space, which those undelivered steps hold"
    if lanes_full:
        return "every producer waits for lane space: raise --shm-size or lower --buffer"
    if slow is not None:
        name, identity, seconds_in = slow
        return (
            f"{producers} producers attached, and producer {name} has been inside "
            f"dataset[{identity}] for {seconds_in:.0f} s; a sample that slow holds up the "
            "round (speed up its preprocessing; a --workers process inside one sample for "
            "--lease-timeout is killed as hung)"
        )
    if buffered == 0 and rejected:
        return (
            f"{producers} producers attached but every sample since the last round was "
            f"rejected {rejected}"
        )
    return f"{producers} producers attached and making samples"


def _describe_rank(queue: RankQueue) -> str:
    first = queue.first_undelivered()
    where = f" from epoch {first[0]} step {first[1]}" if first is not None else ""
    client = "its client is attached" if queue.attached else "no client attached"
    return f"rank {queue.rank} has {queue.queued_steps()} steps undelivered{where}, {client}"


class RoundWaiting(RoundEnding):
    """Step 1 of a round: wait until this node can offer it, and say why it cannot yet."""

    def _queued_min(self) -> int:
        """Fewest steps queued for a rank that still trains (0 once every local rank ended:
        its node must keep offering rounds, or the others' end points could never arrive)."""
        live = [q.queued_steps() for q in self.queues.values() if q.end_point is None]
        return min(live, default=0)

    async def _wait_ready(self) -> None:
        reported = ""  # the last reason sent to the hub, so an unchanged wait sends nothing
        while True:
            self.barrier.raise_failure()  # a lost peer fails the job now, not at the next round
            if self.fatal is not None:
                self.abort(self.fatal)
                await self._tell_trainers()
                raise JobFailed(self.fatal)
            if self._end_unsent:
                return  # a local rank's end_job() point goes to every node with this round
            room = self._queued_min() <= self.config.steps_ahead
            if room and (self.state.units_ready() or self._round_rejected()):
                return
            if room and self._buffer_capped_by_lanes():
                self._count_lanes_full_round()
                return
            self.progress.clear()
            self._room = room
            try:
                # asyncio.timeout, not wait_for: this runs on every commit and Delivered, and
                # wait_for wraps the wait in a new Task each time.
                async with asyncio.timeout(self.config.stall_s):
                    await self.progress.wait()
            except TimeoutError:
                # Producers made no progress for stall_s: rather than starve the trainers,
                # plan with what is buffered once they are about to run dry.
                if self._queued_min() <= 1 and self.state.buffered_now() > 0:
                    return
                reason = self._wait_reason(room)
                self._log_waiting(reason)
                if reason != reported:
                    round_index = barrier_round(self.round_index, 0, self.split.per_round)
                    await self.barrier.report_waiting(round_index, reason)
                    reported = reason
            finally:
                self._room = None

    def ingest_progress(self) -> None:
        """A commit, rejection, LaneFull or producer change: it may end a wait for buffers,
        never a wait for queue room (only Delivered reports make room), so that wait sleeps on."""
        if self._room is not False:
            self.progress.set()

    def trainer_progress(self) -> None:
        """A Delivered report (or steps skipped on resume): it may end a wait for queue room,
        never a wait for buffers, so that wait sleeps on. Without the split, every commit and
        every report woke the loop to find nothing to do."""
        if self._room is not True:
            self.progress.set()

    def _round_rejected(self) -> bool:
        """A round's worth of this node's samples was rejected and none is buffered: offer the
        empty round anyway, so the counts reach every node and the epoch can end (non-join
        epochs end by counting rejections against the quota)."""
        capacity = self.state.planner.unit_capacity * len(self.state.local_unit_ids())
        rejected = sum(self.state.rejected.values())
        return self.state.buffered_now() == 0 and rejected >= capacity

    def _buffer_capped_by_lanes(self) -> bool:
        """Every producer waits for lane space with samples buffered: the buffer cannot fill
        before this round frees shared memory, so plan now rather than wait stall_s."""
        return self.state.buffered_now() > 0 and self.lanes_full()

    def _count_lanes_full_round(self) -> None:
        """Counts a round offered short because the lanes are full; the first one warns."""
        self.stats.lanes_full_rounds += 1
        if self.lanes_full_warned:
            return
        self.lanes_full_warned = True
        per_sample = self.stats.ingest_bytes / max(self.stats.ingest_samples, 1)
        capacity = self.state.planner.unit_capacity * len(self.state.local_unit_ids())
        log.warning(
            "round %d: the producer lanes (%.1f MiB each) filled up with %d samples "
            "buffered, short of the %d a round takes (%.1f MiB at %.2f MiB per sample), so "
            "rounds are planned with what the lanes hold: smaller rounds, more of them. For "
            "full rounds raise --shm-size or lower --buffer (odbd_lanes_full_rounds_total "
            "counts these rounds).",
            self.round_index,
            self.lanes.lane_bytes / 2**20,
            self.state.buffered_now(),
            capacity,
            capacity * per_sample / 2**20,
            per_sample / 2**20,
        )

    def _wait_reason(self, room: bool) -> str:
        """Why this node cannot offer the round yet, naming the ranks that hold it up.

        No room: every local rank has more than --steps-ahead steps queued, so the ranks that
        have not taken theirs are named. Room but no full buffer: producers are short, and if a
        rank sits on far more queued steps than --steps-ahead, its undelivered batches hold the
        shared memory the producers need, so it is named too.
        """
        lagging = sorted(
            (q for q in self.queues.values() if q.queued_steps() > self.config.steps_ahead),
            key=lambda q: (-q.queued_steps(), q.rank),
        )
        ranks = "; ".join(_describe_rank(q) for q in lagging[:4])
        if not room:
            return (
                f"its trainers have not taken their queued steps ({ranks}); a rank that stopped "
                "calling next() (hung, deadlocked, or stuck outside the loop) holds up the job"
            )
        producers = (
            f"its producers filled {self.state.buffered_now()} of the "
            f"{self.state.planner.unit_capacity} samples a unit buffers "
            f"({len(self.state.leases)} leases out): "
            + wait_reason(
                producers=self.producers(),
                buffered=self.state.buffered_now(),
                rejected=dict(self.state.rejected),
                lanes_full=self.lanes_full(),
                starting=self.starting(),
                slow=self.slow_sample(),
                held_by_ranks=bool(lagging),
            )
        )
        if lagging:
            # The rank first: it is the cause, and the lanes-full advice (raise --shm-size)
            # read first sent operators to resize memory for a stopped trainer.
            return (
                f"shared memory is held by undelivered steps ({ranks}); a rank that stopped "
                f"calling next() holds up the job, and meanwhile {producers}"
            )
        return producers

    @property
    def waiting_for(self) -> str:
        """What the next round waits for, for `odbd status` and a stalled trainer's error."""
        if self._exchanging:
            # Read after "waits because": it was "the other nodes' offers for round K", which
            # neither read as a reason nor said for how long or when a deadline names the node.
            since_s = time.monotonic() - self._exchange_started_s
            return (
                f"not every other node has sent its offer for round {self.round_index} yet "
                f"(this node sent its own {since_s:.0f} s ago; at --round-timeout "
                f"{self.config.round_timeout_s:g} s the hub fails the job naming the missing node)"
            )
        return "" if self._room is None else self._wait_reason(self._room)

    def _log_waiting(self, reason: str) -> None:
        now = time.monotonic()
        if now - self.last_wait_log < _WAIT_LOG_S:
            return
        self.last_wait_log = now
        log.info("round %d waits: %s", self.round_index, reason)
