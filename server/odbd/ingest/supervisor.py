"""Spawns and supervises the daemon's producer processes (`--dataset MODULE:FACTORY --workers K`).

Each worker is `python -m odbclient.producer.producer_main`, a plain odbclient Producer: the daemon
treats it exactly like an external producer. It is spawned (vfork + exec), never forked from
this process, whose gRPC threads made forked producers crash at start-up (spawn.py).

A worker that dies is restarted (its leases went back to the pool when its stream broke, and a
sample that kept killing producers was quarantined). One that dies _MAX_DEATHS times within
_RESTART_WINDOW_S with no sample made on the node in between cannot be kept alive: it is given
up, and the job fails (on_give_up). A worker that keeps dying while the others make samples
(say it fails at start-up) is restarted after a delay that doubles with each death in a row, up
to _MAX_RESTART_DELAY_S, so it costs one start every half minute, not two a second.

Stopping: workers run in their own session, so a terminal's Ctrl-C (SIGINT to the foreground
process group) reaches only the daemon, which stops them itself: Shutdown on their stream,
then SIGKILL after a short grace. Once stopping, none is restarted. They never outlive the
daemon: their stream breaks when it dies, and `producer_guard` makes the kernel kill them
when it does (PR_SET_PDEATHSIG), even while one is stuck in the user's preprocessing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from odbd.ingest.spawn import SpawnedProcess, spawn

log = logging.getLogger("odbd.producers")

_MAX_DEATHS = 5  # in a row within _RESTART_WINDOW_S, no sample made between: give up
_RESTART_WINDOW_S = 60.0
_RESTART_DELAY_S = 0.5
_MAX_RESTART_DELAY_S = 30.0
# A worker that ran this long before it died was healthy: its next death starts a new series.
_HEALTHY_RUN_S = 60.0
# After Shutdown, a worker still running is inside the user's preprocessing (or still
# starting): its work is lost either way, so it is killed soon (Ctrl-C must end the daemon
# within 2 s).
_STOP_GRACE_S = 0.5


@dataclass(frozen=True, kw_only=True, slots=True)
class SupervisorConfig:
    socket: str
    dataset: str
    dataset_args: tuple[tuple[str, str], ...]
    workers: int
    job_id: str


@dataclass(slots=True)
class _Worker:
    name: str
    process: SpawnedProcess | None = None
    deaths: list[float] = field(default_factory=list)  # since the node last made a sample
    deaths_in_a_row: int = 0  # each within _HEALTHY_RUN_S of its start
    started_s: float = 0.0  # time.monotonic() when its current process started


def deaths_without_progress(
    deaths: list[float], now_s: float, progressed: bool, window_s: float = _RESTART_WINDOW_S
) -> list[float]:
    """A worker's deaths that count towards giving up, after one more at `now_s`: a death
    after the node made samples (committed or rejected, a quarantine included) starts a new
    run, so a worker that dies on each of several bad samples is restarted for every one."""
    if progressed:
        return [now_s]
    return [t for t in deaths if now_s - t < window_s] + [now_s]


def restart_delay_s(deaths_in_a_row: int) -> float:
    """How long a worker that died this many times in a row waits before its restart."""
    doublings = min(max(deaths_in_a_row - 1, 0), 16)
    return min(_RESTART_DELAY_S * 2.0**doublings, _MAX_RESTART_DELAY_S)


class ProducerSupervisor:
    def __init__(
        self,
        config: SupervisorConfig,
        on_restart: Callable[[], None],
        progress: Callable[[], int] = lambda: 0,
        on_give_up: Callable[[str], None] = lambda message: None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.config = config
        self._on_restart = on_restart
        self._progress = progress  # samples the node made so far (committed + rejected)
        self._on_give_up = on_give_up
        self._sleep = sleep  # a test's clock
        self._workers = [_Worker(f"worker-{i}") for i in range(config.workers)]
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.num_restarts = 0

    def command(self, name: str) -> list[str]:
        """The producer's command line, as an operator would run it by hand."""
        args = [
            sys.executable,
            "-m",
            "odbclient.producer.producer_main",
            "--socket",
            self.config.socket,
        ]
        args += ["--dataset", self.config.dataset, "--name", name, "--job-id", self.config.job_id]
        for key, value in self.config.dataset_args:
            args += ["--dataset-arg", f"{key}={value}"]
        return args

    def by_hand_command(self, name: str) -> list[str]:
        """The worker's command without the daemon's guard: for an operator to run."""
        args = self.command(name)
        return [args[0], "-m", "odbclient.producer.producer_main", *args[3:]]

    async def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._keep_running(w)) for w in self._workers]

    async def _keep_running(self, worker: _Worker) -> None:
        while not self._stopping:
            made = self._progress()
            started = worker.started_s = time.monotonic()
            # Spawned, never forked from this threaded process (spawn.py says why); in its
            # own session, as a terminal's SIGINT is the daemon's to handle.
            worker.process = spawn(
                _guarded(self.command(worker.name)),
                env={**os.environ, "ODBD_DAEMON_PID": str(os.getpid())},  # producer_guard
            )
            code = await worker.process.wait()
            if self._stopping or code == 0:
                return
            healthy = time.monotonic() - started >= _HEALTHY_RUN_S
            worker.deaths_in_a_row = 1 if healthy else worker.deaths_in_a_row + 1
            # The daemon accounts for the sample in flight when it sees the stream end; the
            # first delay gives it that moment, so a quarantine by this very death counts.
            await self._sleep(_RESTART_DELAY_S)
            if self._stopping:
                return
            now = time.monotonic()
            worker.deaths = deaths_without_progress(worker.deaths, now, self._progress() > made)
            if len(worker.deaths) >= _MAX_DEATHS:
                self._give_up(worker, code)
                return
            delay_s = restart_delay_s(worker.deaths_in_a_row)
            in_a_row = worker.deaths_in_a_row
            log.warning(
                "producer %s exited with status %s; restarting it%s",
                worker.name,
                code,
                f" in {delay_s:g} s ({in_a_row} deaths in a row)" if in_a_row > 1 else "",
            )
            await self._sleep(delay_s - _RESTART_DELAY_S)
            if self._stopping:
                return
            self.num_restarts += 1
            self._on_restart()

    def _give_up(self, worker: _Worker, code: int) -> None:
        message = (
            f"producer {worker.name} died {len(worker.deaths)} times within "
            f"{_RESTART_WINDOW_S:.0f} s with no sample made in between (last exit status "
            f"{code}); it cannot be kept alive, so the job fails. Run "
            f"`{shlex.join(self.by_hand_command(worker.name))}` by hand to see why"
        )
        log.error("%s", message)
        self._on_give_up(message)

    def running(self) -> tuple[int, float]:
        """How many workers have a live process, and seconds since the first of them started
        (0.0 if none): while none is attached yet, they are still building the dataset."""
        live = [w for w in self._workers if w.process and w.process.returncode is None]
        if not live:
            return 0, 0.0
        return len(live), time.monotonic() - min(w.started_s for w in live)

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process and w.process.returncode is None]

    def supervises(self, name: str) -> bool:
        """Whether `name` is one of this daemon's --workers (external producers are not)."""
        return any(w.name == name for w in self._workers)

    def kill_hung(self, name: str) -> int | None:
        """SIGKILLs worker `name`, hung in the user's dataset[i], with whatever it spawned (it
        leads its own session); `_keep_running` restarts it as after any death. Its pid, or
        None if it is not a live worker."""
        worker = next((w for w in self._workers if w.name == name), None)
        if worker is None or worker.process is None or worker.process.returncode is not None:
            return None
        pid = worker.process.pid
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return pid

    def stop_restarting(self) -> None:
        """The daemon is stopping: a worker that exits from now on stays down."""
        self._stopping = True

    def kill_now(self) -> None:
        """The daemon exits at once (second signal): SIGKILL every worker, synchronously."""
        self._stopping = True
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def stop(self) -> None:
        """Workers exit on the daemon's Shutdown message; stragglers are killed."""
        self._stopping = True
        alive = [w.process for w in self._workers if w.process and w.process.returncode is None]
        if alive:
            done = asyncio.gather(*(p.wait() for p in alive))
            try:
                await asyncio.wait_for(done, _STOP_GRACE_S)
            except TimeoutError:
                for p in alive:
                    if p.returncode is None:
                        # Usually past Shutdown, in the interpreter's teardown (seconds with
                        # torch imported): nothing is lost by killing it.
                        log.debug("producer pid %d still runs %g s after Shutdown; killing it",
                                  p.pid, _STOP_GRACE_S)  # fmt: skip
                        p.kill()
                await asyncio.gather(*(p.wait() for p in alive))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _guarded(command: list[str]) -> list[str]:
    """`python -m odbclient.producer.producer_main ARGS` through producer_guard (dies with us)."""
    python, _, module, *args = command
    return [python, "-m", "odbd.ingest.producer_guard", module, *args]
