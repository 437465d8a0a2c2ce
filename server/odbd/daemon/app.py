"""The node daemon's life: startup -> round loop -> end of job -> shutdown (uvicorn-style).

1. startup (startup.py; resume.py with --state-dir): claim the socket path, create the arena,
   serve the unix socket (serving.py: ingest, trainer, admin, health), form the job with the
   peer daemons, spawn producers.
2. main: the round loop until every epoch is planned, while every local rank must attach
   within --attach-timeout (or the job fails naming it).
3. end of job: wait until every local rank took the job's end (job_end.py: no fixed grace);
   a signal waits only for attached ranks, within --drain-timeout.
4. shutdown (shutdown.py, with failures and signals): stop producers, servers and the
   barrier; close the journal; unlink the arena and the socket this daemon created. Each step
   runs even when an earlier one failed.
Any failure in 1-3 ends the job the same way (`_fail`): one ERROR line, trainers get
JobFailedError with the reason, exit 1 (2 for an operator error found at start-up).
A second signal exits at once (`_force_exit`), still releasing shm, the socket and producers.
What the daemon holds is daemon_state.DaemonState; each concern is a class over it (the
callbacks between its parts: daemon_callbacks.py), and Daemon is all of them with steps 2-3.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from odbd.config import DaemonConfig
from odbd.daemon.daemon_state import END_POLL_S
from odbd.daemon.job_end import (
    Outcome,
    attach_failure,
    dropped_summary,
    end_verdict,
    overdue_ranks,
    presences,
)
from odbd.daemon.shutdown import DaemonStopping
from odbd.daemon.startup import DaemonStartup
from odbd.errors import OdbdError
from odbd.round.traffic import round_work_line

log = logging.getLogger("odbd")

_EXPIRY_PERIOD_S = 1.0
_ATTENDANCE_PERIOD_S = 0.5  # how often the attach deadline is checked
_LOOP_STOP_S = 1.0  # how long a stop waits for the cancelled round loop to wind down
_END_WAIT_LOG_S = 30.0  # the end-of-job wait says what it waits for this often


class AttachTimeoutError(OdbdError):
    """A local rank stayed away past --attach-timeout: the job cannot end with every step."""


class EndJobError(OdbdError):
    """ODBClient.end_job() calls that cannot end the job (different steps, or a rank missing
    past --end-timeout): daemon/end_requests.py says which ranks."""


class Daemon(DaemonStartup, DaemonStopping):
    """One node daemon's life, in the order of the module docstring."""

    async def run(self) -> int:
        """The daemon's whole life; returns its exit status (0 only if nothing was dropped)."""
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            if await self._form_job(stop):
                await self._run_job(stop)
        except Exception as error:  # noqa: BLE001 - every failure ends the job the same way
            await self._fail(error)
        finally:
            stop.cancel()
            await self.shutdown()
        return self.exit_code

    async def _form_job(self, stop: asyncio.Future[Any]) -> bool:
        """1. startup; False if a signal came first (peers may take minutes to join)."""
        await self._serve_health_tcp()
        starting = asyncio.ensure_future(self.startup())
        await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            log.info("stopped (%s) before the job formed", self._stop_signal)
            return False
        starting.result()  # raises the start-up error, if any
        self._job_formed = True
        self._ready_s = time.monotonic()
        return True

    async def _run_job(self, stop: asyncio.Future[Any]) -> None:
        """2. the round loop, then 3. the end of the job."""
        assert self.loop is not None
        background = [asyncio.ensure_future(self._expire_leases())]
        try:
            if self.journal_records is not None:
                await self._resume()
            self.phase = "running"
            background.append(asyncio.ensure_future(self._watch_health()))
            main = asyncio.ensure_future(self.loop.run())
            attendance = asyncio.ensure_future(self._watch_attendance())
            await asyncio.wait({main, stop, attendance}, return_when=asyncio.FIRST_COMPLETED)
            attendance.cancel()
            if main.done():
                main.result()  # raises the round's error, if any
                s = self.stats
                log.info("%s", round_work_line(s.round_traffic, s.rounds, s.round_planning.total))
            elif attendance.done():
                attendance.result()  # raises AttachTimeoutError
            else:
                main.cancel()
                # Steps already queued were planned on every node: the trainers may take them.
                # fail() also ends the loop at its next check, should a wait inside it swallow
                # the cancellation (it did: rounds went on being planned after the signal).
                self.loop.fail(f"the daemon was stopped ({self._stop_signal})")
                await asyncio.wait({main}, timeout=_LOOP_STOP_S)
            if self.phase == "running":
                self.phase = "draining"
            await self._update_health()
            await self._end_job()
        finally:
            for task in background:
                task.cancel()

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(_EXPIRY_PERIOD_S)
            if self.ingest is not None:
                self.ingest.expire_leases()

    async def _watch_attendance(self) -> None:
        """While rounds run: a rank away past --attach-timeout fails the job, naming it."""
        timeout_s = self.config.attach_timeout_s
        while True:
            await asyncio.sleep(_ATTENDANCE_PERIOD_S)
            ranks = presences(self.queues.values(), ready_s=self._ready_s, now_s=time.monotonic())
            overdue = overdue_ranks(ranks, timeout_s)
            if overdue:
                raise AttachTimeoutError(attach_failure(overdue, timeout_s))
            self._check_end_requests()

    def _check_end_requests(self) -> None:
        """end_job() calls that failed the job (different steps, a rank past --end-timeout)."""
        loop = self.loop
        if loop is not None and loop.ending:
            reason = loop.failure or loop.end_overdue(time.monotonic())
            if reason:
                raise EndJobError(reason)

    async def _end_job(self) -> None:
        """3. Waits until every local rank took the job's end (job_end.end_verdict)."""
        last_log_s = time.monotonic()
        while True:
            now_s = time.monotonic()
            verdict = end_verdict(
                presences(self.queues.values(), ready_s=self._ready_s, now_s=now_s),
                attach_timeout_s=self.config.attach_timeout_s,
                stopping=self._stop.is_set(),
                stop_overdue=now_s > self._stop_deadline_s,
            )
            self._check_end_requests()  # every step was planned: this node decides alone
            if self.barrier is not None and not self._stop.is_set():
                # A node lost after the last round fails the job now, as one lost mid-epoch
                # does: its ranks' collectives would hang ours (a stop drains regardless).
                self.barrier.raise_loss()
            if verdict.outcome is Outcome.DONE:
                if not self._stop.is_set():
                    self.phase = "done"
                log.info("every local rank took the job's end")
                return
            if verdict.outcome is Outcome.FAIL:
                raise AttachTimeoutError(verdict.reason)
            if verdict.outcome is Outcome.STOP:
                self._report_dropped(dropped_summary(verdict.dropped))
                return
            if now_s - last_log_s >= _END_WAIT_LOG_S:
                last_log_s = now_s
                log.info("the job's end is queued; waiting for %s", verdict.reason)
            await asyncio.sleep(END_POLL_S)

    def _report_dropped(self, summary: str) -> None:
        """A stop's drain is over: say what it dropped; dropping anything is a failed exit."""
        if not summary:
            log.info("stopped (%s): every queued step was delivered", self._stop_signal)
            return
        log.error(
            "stopped (%s) before trainers took everything, %s; these steps are lost "
            "(restart with --state-dir to produce them again)",
            self._stop_signal,
            summary,
        )
        self.last_error = f"stopped before trainers took everything: {summary}"
        self.exit_code = 1


def run_daemon(config: DaemonConfig, dataset_size: int) -> int:
    """Runs one daemon to completion in its own event loop (uvloop when available), then ends
    the process with its exit status."""
    runner: Callable[[Coroutine[Any, Any, int]], int]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        runner = asyncio.run

    async def main() -> int:
        daemon = Daemon(config, dataset_size)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.on_signal, sig)
        return await daemon.run()

    code = runner(main())
    # Everything is released by now. The interpreter's own teardown (torch is imported by
    # odbclient) took 1-2.5 s on a loaded 2-core machine: skip it, so Ctrl-C ends the daemon
    # in well under 2 s.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
