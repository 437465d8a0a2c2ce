"""How the daemon stops: a failure ends the job the same way from any step (one ERROR line,
trainers told why, exit 1, 2 for an operator error at start-up); the first signal drains within
--drain-timeout, a second exits at once; shutdown releases everything, each step running even
when an earlier one failed."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import time
from collections.abc import Callable
from functools import partial

from grpc_health.v1 import health_pb2

from odbclient.wire.odbd.v1 import (
    trainer_pb2,
)
from odbd.daemon.daemon_state import END_POLL_S, DaemonState
from odbd.daemon.job_end import (
    Outcome,
    end_verdict,
    presences,
)
from odbd.errors import ConfigError, OdbdError
from odbd.serve.rank_queue import QueuedItem

log = logging.getLogger("odbd")

# A failing job tells attached trainers why (JobFailedError) before its streams close: their
# failed JobEnd goes out at once (RankQueue.finished), so this only bounds a stuck stream.
_FAILURE_NOTICE_S = 5.0
EXIT_USAGE = 2  # an operator error found at start-up (as for bad flags, cli.py)
# What a forced exit (second signal) still does, synchronously, before os._exit.
_FORCED_EXIT_STEPS = ("unlink shared memory", "remove the socket")


class DaemonStopping(DaemonState):
    """Failure, signals and step 4 of the daemon's life, shutdown."""

    # -- failure -----------------------------------------------------------------------------

    async def _fail(self, error: Exception) -> None:
        """Ends the job on any error: one ERROR line, trainers told why, exit 1 (2 for an
        operator error at start-up)."""
        reason = _describe_failure(error)
        if isinstance(error, OdbdError | OSError):
            log.error("%s", reason)
        else:  # a bug in odbd: the traceback is what a report needs
            log.error("%s", reason, exc_info=error)
        self.phase, self.last_error = "failed", reason
        start_up = isinstance(error, ConfigError) and not self._job_formed
        self.exit_code = EXIT_USAGE if start_up else 1
        try:
            if self.barrier is not None and self._job_formed:
                await self.barrier.fail_job(reason)  # every daemon fails with this reason
            if self.rewinder is not None:  # a gated queue would hold back the failed JobEnd
                self.rewinder.cancel_all()
            self._tell_trainers(reason)
            await self._announce_failure()
        except Exception as notice_error:  # noqa: BLE001 - shutdown must still run
            log.error("could not tell the trainers why the job failed: %s", notice_error)

    def _tell_trainers(self, reason: str) -> None:
        """Unsent steps are dropped and a failed JobEnd follows what was already sent."""
        if self.loop is not None and not self.loop.done:
            self.loop.abort(reason)
            return
        end = trainer_pb2.JobEnd(reason=reason, failed=True)
        for queue in self.queues.values():
            queue.fail_job(QueuedItem(self.state.epoch, -1, trainer_pb2.TrainerEvent(job_end=end)))

    async def _announce_failure(self) -> None:
        """Lets attached trainers read their failed JobEnd before the streams close."""
        deadline_s = time.monotonic() + _FAILURE_NOTICE_S
        while time.monotonic() < deadline_s:
            verdict = end_verdict(
                presences(self.queues.values(), ready_s=self._ready_s, now_s=time.monotonic()),
                attach_timeout_s=self.config.attach_timeout_s,
                stopping=True,
            )
            if verdict.outcome is not Outcome.WAIT:
                return
            await asyncio.sleep(END_POLL_S)

    # -- signals -----------------------------------------------------------------------------

    def on_signal(self, signum: int) -> None:
        """The first SIGTERM/SIGINT drains (request_stop); a second one exits at once."""
        name = signal.Signals(signum).name
        self._signals += 1
        if self._signals > 1:
            self._force_exit(name, 128 + signum)
        log.info(
            "%s received: draining within --drain-timeout %g s (send it again to force exit)",
            name,
            self.config.drain_timeout_s,
        )
        self.request_stop(name)

    def request_stop(self, signal_name: str = "SIGTERM") -> None:
        """NOT_SERVING at once, no producer restarts, then drain within --drain-timeout."""
        self._stop_signal = signal_name
        self.phase = "draining"
        self.stats.serving = False
        self._stop_deadline_s = time.monotonic() + self.config.drain_timeout_s
        if self.supervisor is not None:
            self.supervisor.stop_restarting()
        loop = asyncio.get_running_loop()
        loop.create_task(self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
        self._stop.set()

    def _force_exit(self, signal_name: str, code: int) -> None:
        """Second signal: no drain, but producers, shm and the socket are still released."""
        log.error(
            "second signal (%s): exiting now with status %d; steps not yet delivered are lost",
            signal_name,
            code,
        )
        steps = [(w, s) for w, s in self._shutdown_steps() if w in _FORCED_EXIT_STEPS]
        if self.supervisor is not None:
            steps.insert(0, ("kill the producers", self.supervisor.kill_now))
        for what, step in steps:
            try:
                step()
            except Exception as error:  # noqa: BLE001 - the exit must happen regardless
                log.error("forced exit: could not %s: %s", what, error)
        logging.shutdown()
        os._exit(code)

    # -- shutdown ----------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """4. Releases everything; a failing step is logged once and the next still runs."""
        for what, step in self._shutdown_steps():
            try:
                result = step()
                if inspect.isawaitable(result):
                    await result
            except Exception as error:  # noqa: BLE001 - the remaining resources must be released
                log.error(
                    "shutdown: could not %s (%s: %s); releasing the rest",
                    what,
                    type(error).__name__,
                    error,
                )

    def _shutdown_steps(self) -> list[tuple[str, Callable[[], object]]]:
        """What shutdown releases, in order: what exists of it (start-up may have failed)."""
        steps: list[tuple[str, Callable[[], object]]] = [
            ("mark health NOT_SERVING", self.health.enter_graceful_shutdown)
        ]
        if self.ingest is not None:
            steps.append(("tell producers to stop", partial(self.ingest.shutdown, "job over")))
        if self.supervisor is not None:
            steps.append(("stop the producers", self.supervisor.stop))
        if self.ingest_server is not None:
            steps.append(("stop the ingest socket server", self.ingest_server.close))
        if self.step_server is not None:
            steps.append(("stop the step socket server", self.step_server.close))
        if self.server is not None:
            steps.append(("stop the socket server", partial(self.server.stop, 1.0)))
        if self._health_server is not None:
            steps.append(("stop the health server", partial(self._health_server.stop, 0.5)))
        if self.migration is not None:
            steps.append(("close the bulk port", self.migration.close))
        if self.barrier is not None:
            steps.append(("close the round barrier", self.barrier.close))
        if self._metrics_server is not None:
            steps.append(("stop the metrics server", self._stop_metrics))
        if self.journal is not None:
            steps.append(("close the journal", self.journal.close))
        if self.arena is not None:
            steps.append(("unlink shared memory", self.arena.close))
        steps.append(("remove the socket", self._unlink_socket))
        return steps

    def _stop_metrics(self) -> None:
        self._metrics_server.shutdown()
        self._metrics_server.server_close()

    def _unlink_socket(self) -> None:
        """Removes the socket file only if it is still the one this daemon bound."""
        if self.step_server is not None:
            self.step_server.unlink()
        if self.ingest_server is not None:
            self.ingest_server.unlink()
        if self._socket_id is None:
            return  # never bound: the file (if any) belongs to someone else
        with contextlib.suppress(FileNotFoundError):
            info = os.stat(self.config.socket)
            if (info.st_dev, info.st_ino) == self._socket_id:
                os.unlink(self.config.socket)


def _describe_failure(error: Exception) -> str:
    """One line for the log, `odbd status` and the trainers' JobFailedError."""
    if isinstance(error, OdbdError):
        return str(error)
    if isinstance(error, OSError):
        return (
            f"the job stopped on an operating-system error: {error}; free the disk space or "
            "fix the file or limit behind it, then restart the job (with --state-dir it resumes)"
        )
    return (
        f"the job stopped on an internal error (a bug in odbd; please report it with this "
        f"log): {type(error).__name__}: {error}"
    )
