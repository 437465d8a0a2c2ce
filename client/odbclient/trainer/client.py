"""ODBClient: one trainer rank's iterator over the step-aligned batches of its node's daemon.

    client = ODBClient(rank=int(os.environ["RANK"]))
    for batch in client:          # one epoch; iterate again for the next
        ...

Data path: the daemon pushes StepBatch events ahead of time over its step socket (a unix
socket of length-prefixed protobuf frames, odbclient.framing); a reader thread
(`odbclient.stream`) collates each from shared memory into fresh tensors and queues the Batch,
so next() only takes a ready batch from a queue. Each batch handed to the user is reported
`Delivered` (which lets the daemon reuse the step's shared memory and measures the trainer's
wait and compute time). next() only queues the report; odbclient.reports batches them and
the stream's reader thread writes them to the socket (why: no thread wake-up inside next()).
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import time
import weakref
from collections.abc import Generator, Iterator, Mapping
from typing import Any

from odbclient.connect import (
    DEFAULT_PREFETCH,
    DEFAULT_SOCKET,
    JOB_ID_ENV,
    Failure,
    StreamEnd,
    resolve_socket,
)
from odbclient.errors import (
    DaemonConnectionError,
    DaemonTimeoutError,
    IteratorInUseError,
    JobFailedError,
    StateDictError,
)
from odbclient.trainer.align import (
    EPOCH_END_STEP,
    JOB_END_EPOCH,
    Position,
    agreed_resume,
    distributed_world,
    gather_positions,
    position_of,
)
from odbclient.trainer.batch import Batch
from odbclient.trainer.staged_stream import StagedStream
from odbclient.trainer.stream import EpochEnd, JobEnd, TrainerStream, TrainerWorld, daemon_says

__all__ = ["DEFAULT_SOCKET", "ODBClient"]

STATE_VERSION = 1
log = logging.getLogger(__name__)
# Where the step stream is read and collated: "thread", a reader thread in this process;
# "process", a reader process per rank (odbclient.reader_process), so this process only copies
# a staged batch (issue 15: the trainer process's CPU per step).
READERS = ("thread", "process")
READER_ENV = "ODBCLIENT_READER"
DEFAULT_READER = "thread"
_FLUSH_AFTER_WAIT_S = 0.001  # next() blocked this long: send unsent Delivered reports


def launcher_world(environ: Mapping[str, str] = os.environ) -> TrainerWorld:
    """This process's world: torch.distributed's when initialised, else the launcher's
    WORLD_SIZE and RANK (torchrun, accelerate launch with several processes); unknown if none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return TrainerWorld(dist.get_world_size(), dist.get_rank(), "torch.distributed")
    size, rank = environ.get("WORLD_SIZE"), environ.get("RANK")
    names = [f"${k}={environ[k]}" for k in ("WORLD_SIZE", "RANK") if k in environ]
    try:
        return TrainerWorld(
            None if size is None else int(size),
            None if rank is None else int(rank),
            ", ".join(names),
        )
    except ValueError:
        raise ValueError(
            f"{', '.join(names)}: WORLD_SIZE and RANK must be integers; fix the launcher's "
            "environment (torchrun sets both)"
        ) from None


class ODBClient:
    """The batches of one trainer rank, one epoch per iteration.

    `socket`: the daemon's unix socket; else $ODBD_SOCKET, else the per-user default
        ($XDG_RUNTIME_DIR/odbd/odbd.sock or /tmp/odbd-$UID/odbd.sock, odbclient.local_trust).
        The socket and the daemon behind it must be this user's or root's
        (UntrustedDaemonError otherwise, before anything is sent).
    `job_id`: the job this rank belongs to; a daemon of another --job-id refuses it
        (JobMismatchError). Default: $ODBD_JOB_ID (which the daemons' --job-id also reads),
        else "" (any job).
    `prefetch`: batches the daemon may push ahead of the one the trainer is on. Raise it for
        very short steps (8 KiB samples, no compute: 24k samples/s at 8, 27-28k at 32); each
        prefetched batch costs trainer memory, and a rank may train that many batches after a
        peer node dies before JobFailedError.
    `connect_timeout_s`: how long the first iteration waits for the daemon to start and welcome.
    `deadline_s`: the longest wait for any batch; past it DaemonTimeoutError names the socket
        and what the daemon's status reports (phase, last error, what the round waits for).
    `reader`: where the daemon's step stream is read and each step collated: "thread" (a
        reader thread in this process), or "process" (a reader process per rank, started and
        ended with the stream: this process only copies each staged batch, about half its
        CPU per 8 KiB sample, but inside next(): p50 ~0.2 against ~0.02 ms with data ready;
        the reader process needs a spare core, imports torch (1-8 s, ~270 MB RSS) and
        costs more CPU than the thread did; docs/bench/datapath.md). Default: the
        $ODBCLIENT_READER environment variable, else "thread".
    `align_ranks`: with torch.distributed initialised (world > 1), the first iteration gathers
        every rank's first step over the default process group, and with no `load_state_dict`
        every rank continues where the furthest one does (align.py: after a restart of every
        rank, reports the dead processes never sent would otherwise start the ranks at
        different steps). Only when that group's world is the daemon's --world (not under
        tensor or pipeline parallelism). The gather is a collective: start iterating from the
        thread that runs the job's other collectives (not a prefetch thread), or pass False,
        as also when some ranks of the group never iterate.

    The hello tells the daemon this process's world (`launcher_world()`, or `set_world()`),
    which refuses one that differs from its --world: every loss_scale assumes that world.
    One epoch iterator at a time: a second `iter()` while the first is live raises
    IteratorInUseError. Each Batch carries `progress` (epoch length estimate, fractions of the
    epoch and the job) for LR schedules and progress bars.
    """

    def __init__(
        self,
        rank: int,
        socket: str | None = None,
        *,
        job_id: str | None = None,
        prefetch: int = DEFAULT_PREFETCH,
        connect_timeout_s: float = 60.0,
        deadline_s: float = 600.0,
        align_ranks: bool = True,
        reader: str | None = None,
    ) -> None:
        reader = reader or os.environ.get(READER_ENV) or DEFAULT_READER
        if reader not in READERS:
            raise ValueError(
                f"ODBClient(reader={reader!r}) (or ${READER_ENV}): must be one of "
                f"{', '.join(READERS)}"
            )
        if rank < 0 or prefetch < 1 or connect_timeout_s <= 0 or deadline_s <= 0:
            raise ValueError(
                f"ODBClient(rank={rank}, prefetch={prefetch}, connect_timeout_s="
                f"{connect_timeout_s}, deadline_s={deadline_s}): rank must be >= 0, prefetch "
                ">= 1 and timeouts > 0"
            )
        self.rank = rank
        self.reader = reader
        self.socket = resolve_socket(socket)
        self._job_id = job_id if job_id is not None else os.environ.get(JOB_ID_ENV, "")
        self._prefetch = prefetch
        self._report_every = max(1, prefetch // 2)  # unsent reports: flush (odbclient.reports)
        self._connect_timeout_s = connect_timeout_s
        self._deadline_s = deadline_s
        self._stream: TrainerStream | StagedStream | None = None
        self._align_ranks = align_ranks
        self._first_event: object | None = None  # taken to align the ranks, not yet handed out
        self._resume: tuple[int, int] | None = None  # (epoch, step) from load_state_dict
        self._epoch, self._next_step = 0, 0  # the first step not yet delivered
        # Optimizer updates (Batch.update_*): the first update not finished, and the batch of
        # the update under way (None at an update boundary), so state_dict never splits one.
        self._next_update: int | None = None  # None: the daemon sent no update facts yet
        self._open_update: Batch | None = None
        self._resume_update = 0
        self._last_return_s: float | None = None  # perf_counter when next() last returned
        self._last_batch: tuple[int, int] | None = None  # (epoch, step) next() returned last
        self._last_progress: float | None = None  # job_fraction of the batch returned last
        self._unreported_wait_s = 0.0  # time spent reporting the last Delivered
        self._num_batches, self._num_idle = 0, 0  # delivered this epoch
        self._summary: dict[str, Any] = {}
        self._job_end: JobEnd | None = None
        self._failure: Exception | None = None  # raised again by every later iteration
        self._world: TrainerWorld | None = None  # set_world(); else launcher_world() at connect
        self._live: weakref.ref[Generator[Batch, None, None]] | None = None  # epoch iterator

    # --- iteration -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        if self._failure is not None:
            raise self._failure
        self._refuse_second_iterator()
        if self._job_end is not None:
            return iter(())  # the job is over: every further epoch is empty
        batches = self._epoch_batches(self._connected())
        self._live = weakref.ref(batches)
        return batches

    def _refuse_second_iterator(self) -> None:
        # Live = created and neither exhausted, closed nor garbage: a `for` loop left with
        # `break` drops its iterator, so iterating again afterwards is fine.
        live = self._live() if self._live is not None else None
        if live is not None and inspect.getgeneratorstate(live) != inspect.GEN_CLOSED:
            raise IteratorInUseError(
                f"ODBClient rank {self.rank} already has a live epoch iterator (at epoch "
                f"{self._epoch}, step {self._next_step}): a second iter(client) would split the "
                "epoch's batches between the two; finish the first (or call .close() on it / "
                "drop it) before iterating again, one loop per epoch"
            )

    def _epoch_batches(self, stream: TrainerStream | StagedStream) -> Generator[Batch, None, None]:
        called_s: float | None = None
        while self._job_end is None:  # end_job() inside the loop ends it at the next next()
            if called_s is None:  # kept over skipped slots: they are part of this next()
                called_s = time.perf_counter()
            event = self._next_event(stream)
            if isinstance(event, Batch):
                if event.update_skip:
                    self._skip(stream, event)
                    continue
                self._deliver(stream, event, called_s)
                called_s = None
                yield event
                continue
            stream.reports.flush()  # the epoch or the stream ended: report every batch
            if isinstance(event, EpochEnd):
                last_of_job = self._last_progress is not None and self._last_progress >= 1.0
                self._end_epoch(event)
                if last_of_job:
                    self._take_the_job_end(stream)
                return
            elif isinstance(event, JobEnd):
                self._job_end = event
                if event.failed:
                    self._fail(JobFailedError(f"odbd ended the job on an error: {event.reason}"))
                return
            elif isinstance(event, Failure):
                self._fail(event.error)
            else:
                assert isinstance(event, StreamEnd), event
                self._fail(
                    DaemonConnectionError(
                        f"odbd on unix:{self.socket} closed the stream of rank {self.rank} "
                        "without ending the job (it stopped, crashed or was killed); check the "
                        "daemon log. To continue exactly, start the daemon again with the same "
                        "flags (with --state-dir it resumes the job) and restart the trainers "
                        "from their last checkpoint, loading its odbd state (client."
                        "load_state_dict, resume_from_checkpoint, accelerator.load_state; "
                        "docs/training.md, Checkpoint and resume)"
                    )
                )

    def _take_the_job_end(self, stream: TrainerStream | StagedStream) -> None:
        """After the epoch holding the job's last step (job_fraction 1.0), the daemon has
        queued the JobEnd behind its EpochEnd: taking it now makes `job_ended` true when the
        last epoch's loop ends. Before, `while not client.job_ended: for batch in client: ...`
        (docs/training.md) ran one more, empty epoch, and its per-epoch code (evaluation, a
        checkpoint, `summary`) a second time for the last epoch. Anything else is kept for
        the next iteration, which raises a failed JobEnd as before."""
        event = self._next_event(stream)
        if isinstance(event, JobEnd) and not event.failed:
            self._job_end = event
        else:
            self._first_event = event

    def _next_event(self, stream: TrainerStream | StagedStream) -> object:
        # Flush only once the wait is not brief. The daemon cannot be out of room for us while
        # our inbox is empty: fewer than report_every (<= prefetch / 2) steps are unreported
        # (_deliver flushes at that many), so more than prefetch / 2 pushed steps are still
        # on their way. Flushing at once cost a Delivered and a FreeBatch per step with no
        # compute (issue 15: -20 % samples/s, +7 us daemon CPU per 8 KiB sample); the wait
        # bounds how long frees for full producer lanes or an epoch's end can be held back.
        # (A ready item returns at once: Inbox.take pops it without waiting.)
        if self._first_event is not None:
            event, self._first_event = self._first_event, None
            return event
        try:
            return stream.take(_FLUSH_AFTER_WAIT_S)
        except queue.Empty:
            stream.reports.flush()  # a real wait: the daemon may be waiting for our reports
        try:
            return stream.take(self._deadline_s)
        except queue.Empty:
            raise DaemonTimeoutError(
                f"no batch from odbd on unix:{self.socket} for rank {self.rank} in "
                f"{self._deadline_s:g} s (epoch {self._epoch}, step {self._next_step}): the "
                "daemon, its producers or a peer node is stalled; check `odbd status` and the "
                "daemon log, or raise deadline_s for very slow preprocessing"
                + daemon_says(self.socket)
            ) from None

    def _deliver(self, stream: TrainerStream | StagedStream, batch: Batch, called_s: float) -> None:
        now_s = time.perf_counter()
        compute_s = 0.0 if self._last_return_s is None else called_s - self._last_return_s
        wait_s = now_s - called_s + self._unreported_wait_s
        unsent = stream.reports.add(batch.epoch, batch.step, wait_s=wait_s, compute_s=compute_s)
        if unsent >= self._report_every:
            stream.reports.flush()
        self._epoch, self._next_step = batch.epoch, batch.step + 1
        if batch.update_end:  # --align updates: past this rank's skipped slots of the update
            self._next_step += batch.update_skipped_after
        self._last_batch = (batch.epoch, batch.step)
        self._last_progress = batch.progress.job_fraction
        if batch.windowed:
            self._next_update = batch.update_index + int(batch.update_end)
            self._open_update = None if batch.update_end else batch
        self._num_batches += 1
        self._num_idle += batch.is_idle
        self._last_return_s = time.perf_counter()
        # The report is part of next() too: it is reported with the next step's wait, so the
        # daemon's overlap metric never counts our own overhead as the trainer's compute.
        self._unreported_wait_s = self._last_return_s - now_s

    def _skip(self, stream: TrainerStream | StagedStream, batch: Batch) -> None:
        """A slot after this rank's last micro-step of an update (odbd --align updates): not
        trained and never yielded, but reported like every step, so the daemon's accounting
        (delivered steps, the epoch's end) counts it; the resume point already passed it."""
        unsent = stream.reports.add(batch.epoch, batch.step, wait_s=0.0, compute_s=0.0)
        if unsent >= self._report_every:
            stream.reports.flush()

    def _end_epoch(self, event: EpochEnd) -> None:
        self._summary = {
            "epoch": event.epoch,
            "num_steps": event.num_steps,
            "global_num_samples": event.global_num_samples,
            "num_identities": event.num_identities,
            "rejected_by_reason": dict(event.rejected_by_reason),
            "num_batches": self._num_batches,  # this rank's, idle fillers included
            "num_idle_batches": self._num_idle,
        }
        self._epoch, self._next_step = event.epoch + 1, 0
        self._next_update = 0 if self._next_update is not None else None
        self._open_update = None
        self._num_batches, self._num_idle = 0, 0

    def _fail(self, error: Exception) -> None:
        self._failure = error
        raise error

    def _connected(self) -> TrainerStream | StagedStream:
        if self._stream is None:
            self._stream = self._open(self._resume)
            if self._aligns_over_the_default_group(self._stream):
                self._continue_with_the_other_ranks(self._stream)
        return self._stream

    def _aligns_over_the_default_group(self, stream: TrainerStream | StagedStream) -> bool:
        """Whether every rank of torch.distributed's default group iterates an ODBClient of this
        job: its world is the daemon's. Not so under tensor or pipeline parallelism, where only
        one process per data-parallel rank iterates (set_world declared that world): a gather
        over the default group would wait for processes that never join it."""
        if not self._align_ranks or stream.welcome is None:
            return False
        world = distributed_world()
        return world > 1 and world == stream.welcome.world_size

    def _open(self, resume: tuple[int, int] | None) -> TrainerStream | StagedStream:
        hello: dict[str, Any] = dict(
            rank=self.rank,
            socket=self.socket,
            job_id=self._job_id,
            prefetch=self._prefetch,
            resume=resume,
            resume_update=self._resume_update,
            connect_timeout_s=self._connect_timeout_s,
            world=self._world or launcher_world(),
        )
        if self.reader == "process":
            return StagedStream.open(**hello, report_every=self._report_every)
        return TrainerStream.open(**hello)

    def _continue_with_the_other_ranks(self, stream: TrainerStream | StagedStream) -> None:
        """Every rank continues at the furthest rank's first event (align.py); a rank behind
        reconnects with that resume point, and its daemon drops the steps before it. A rank
        that loaded a state_dict takes part (so no rank waits in the gather for it) but stays
        at its resume point."""
        first = self._next_event(stream)
        own = position_of(first)
        resume = agreed_resume(own, gather_positions(own))
        if resume is None or self._resume is not None:
            self._first_event = first
            return
        log.warning(
            "ODBClient rank %d: the daemon would continue it at %s, but another rank continues "
            "at %s; it continues there too (the ranks restarted without load_state_dict, and "
            "DDP kept them in step, so the steps between were trained)",
            self.rank,
            _where(own),
            _where(resume),
        )
        stream.close()
        self._stream = None  # if the reconnect raises, no closed stream is left to iterate
        self._stream = self._open((resume.epoch, resume.step))
        if resume.epoch != JOB_END_EPOCH and resume.step != EPOCH_END_STEP:
            self._epoch, self._next_step = resume

    def set_world(self, world_size: int, rank: int, *, source: str) -> None:
        """Declares this process's world for the daemon's check, instead of torch.distributed
        or $WORLD_SIZE/$RANK (adapters pass their framework's, e.g. Accelerate's, which knows
        it even for one process); call before the first iteration."""
        if self._stream is not None:
            raise RuntimeError(
                "set_world() after iteration started: the world is sent when connecting; "
                "call it before the first iter(client)"
            )
        self._world = TrainerWorld(world_size, rank, source)

    @property
    def started(self) -> bool:
        """Whether iteration started: the hello (world, job id, resume point) was sent, so
        load_state_dict(), expect_job() and set_world() are refused from now on."""
        return self._stream is not None

    @property
    def epoch(self) -> int:
        """The epoch the next iteration continues: 0 at first, a loaded state's epoch after
        load_state_dict() (so a resumed `for epoch in range(client.epoch, n)` loop starts
        there), the next epoch once an epoch ended."""
        return self._epoch

    @property
    def daemon_job_id(self) -> str | None:
        """The job id of the daemon that welcomed this client; None before the first iteration."""
        welcome = self._stream.welcome if self._stream is not None else None
        return welcome.job_id if welcome is not None else None

    def expect_job(self, job_id: str) -> None:
        """Asks the daemon for `job_id` when connecting, as `ODBClient(job_id=...)` does, so a
        daemon of another job refuses this client (e.g. when resuming from that job's
        checkpoint); call before the first iteration."""
        if self._stream is not None:
            raise RuntimeError(
                "expect_job() after iteration started: the job id is sent when connecting; "
                "call it before the first iter(client)"
            )
        if self._job_id and job_id != self._job_id:
            raise ValueError(
                f"this ODBClient was built for job {self._job_id!r}, not {job_id!r}; build it "
                "with the job id of the checkpoint's job, or resume from that job's checkpoint"
            )
        self._job_id = job_id

    def report_compute(self, seconds: float) -> None:
        """Reports this rank's own compute time for the batch next() returned last.

        Time only the rank's work (forward and backward), not waits in collectives: under DDP
        the time between next() calls includes the gradient all-reduce, where every rank waits
        for the slowest, so it says nothing about this rank's batch. E.g. run forward/backward
        under `model.no_sync()` and all-reduce the gradients after timing, or time up to the
        backward pass with CUDA events. Do include per-step work that waits for nobody, the
        optimizer step (call this after it, before the next next()): it is the fit's per-step
        constant, which tells the planner what one more step costs. With `--cost-model auto`
        the daemons fit the planner's cost model to these reports; without reports it keeps
        the fixed model. Cheap: the time rides along with the next Delivered report.
        """
        if self._last_batch is None or self._stream is None:
            raise RuntimeError("report_compute() before next() returned a batch: nothing to time")
        if not seconds >= 0.0:
            raise ValueError(f"report_compute({seconds!r}): seconds must be >= 0")
        self._stream.reports.add_measured(*self._last_batch, seconds)

    # --- state, summary, lifetime --------------------------------------------------------------

    @property
    def summary(self) -> dict[str, Any]:
        """Facts of the last finished epoch (empty before the first EpochEnd)."""
        return dict(self._summary)

    @property
    def job_ended(self) -> bool:
        return self._job_end is not None

    def end_job(self) -> None:
        """Ends the whole job here: no rank trains another step, and the daemons exit 0.

        Call it on every rank at the same step, i.e. after the same batch (its own loop
        decided: early stopping, its own step cap), as DDP keeps the ranks in step anyway. It
        reports every batch taken so far, tells the daemon this rank's end point (the first
        step it did not train) and waits until every rank of the world has called it; then
        `job_ended` is True, further iterations are empty, and the stream is closed. Batches
        the daemon had already pushed past the end point are dropped, not trained (and not
        counted as lost). Calling it again is a no-op.

        Raises JobFailedError, naming the ranks, when ranks ended at different steps or some
        rank did not call it within the daemons' --end-timeout (a rank that stops while the
        others train on would leave them hanging in their next collective).
        """
        if self._failure is not None:
            raise self._failure
        if self._job_end is not None:
            return
        stream = self._connected()
        stream.send_end_job(self._epoch, self._next_step)
        while self._job_end is None:
            event = self._next_event(stream)
            if isinstance(event, Batch | EpochEnd):
                continue  # planned past the end point: not trained (the daemon drops them)
            if isinstance(event, JobEnd):
                self._job_end = event
                if event.failed:
                    self._fail(JobFailedError(f"odbd ended the job on an error: {event.reason}"))
            elif isinstance(event, Failure):
                self._fail(event.error)
            else:
                self._fail(
                    DaemonConnectionError(
                        f"odbd on unix:{self.socket} closed the stream of rank {self.rank} "
                        "while it waited in end_job() for the other ranks; check the daemon log"
                    )
                )
        self.close()  # the daemon counts the rank as having taken the job's end

    def state_dict(self) -> dict[str, int]:
        """Where to resume: the first step of `epoch` not yet handed to the trainer.

        With optimizer updates (odbd --accumulate / --tokens-per-update) it also holds the
        first update not trained, and it is refused in the middle of an update: a checkpoint
        taken then would hold weights without the update's first micro-steps, and the resumed
        run would never train them."""
        if (open_ := self._open_update) is not None:
            raise StateDictError(
                f"state_dict() in the middle of optimizer update {open_.update_index} of epoch "
                f"{open_.epoch} (micro-step {open_.update_step + 1} of "
                f"{open_.update_num_steps}): its gradient is not in the weights yet, so a "
                "resume would lose it; save checkpoints after optimizer.step(), when the last "
                "batch had update_end"
            )
        state = {"version": STATE_VERSION, "epoch": self._epoch, "step": self._next_step}
        if self._next_update is not None:
            state["update"] = self._next_update
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state` (from state_dict()); call before the first iteration."""
        if self._stream is not None:
            raise StateDictError(
                "load_state_dict() after iteration started: the resume point is sent when "
                "connecting; build a new ODBClient and load the state before iterating"
            )
        if state.get("version") != STATE_VERSION or not all(
            isinstance(state.get(k), int) and state[k] >= 0 for k in ("epoch", "step")
        ):
            raise StateDictError(
                f"not an ODBClient state dict of version {STATE_VERSION}: {state!r}; pass what "
                "ODBClient.state_dict() returned"
            )
        update = state.get("update", 0)
        if not isinstance(update, int) or update < 0:
            raise StateDictError(f"state dict update must be an int >= 0, got {update!r}")
        self._resume = (state["epoch"], state["step"])
        self._epoch, self._next_step = self._resume
        self._resume_update = update
        self._next_update = update if "update" in state else None

    def close(self) -> None:
        """Ends the stream; the daemon re-sends undelivered steps to the rank's next client."""
        if self._stream is not None:
            self._stream.close()

    def __enter__(self) -> ODBClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _where(position: Position) -> str:
    if position.epoch == JOB_END_EPOCH:
        return "the job's end"
    if position.step == EPOCH_END_STEP:
        return f"the end of epoch {position.epoch}"
    return f"epoch {position.epoch} step {position.step}"
