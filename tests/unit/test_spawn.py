"""Producers are spawned, never forked from the threaded daemon (issue 24, item 3).

A fork runs the at-fork hooks (Python's os.register_at_fork ones via PyOS_BeforeFork, gRPC's
pthread_atfork ones); a vfork + exec runs none. So a hook that records every fork tells whether
the supervisor forked this process, here made as threaded as a daemon: a gRPC server running,
under uvloop, whose subprocess_exec forked (the start-up SIGSEGVs of 2-node jobs).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from concurrent import futures

import grpc
import pytest
import uvloop

from odbd.ingest.spawn import spawns_without_fork
from odbd.ingest.supervisor import ProducerSupervisor, SupervisorConfig

_forks: list[int] = []  # OS threads of this process at each fork while _recording
_recording = threading.Event()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _on_fork() -> None:
    if _recording.is_set():
        _forks.append(_threads())


os.register_at_fork(before=_on_fork)


class _ExitsAtOnce(ProducerSupervisor):
    def command(self, name: str) -> list[str]:  # producer_main refuses the unknown flag: exit 2
        return [sys.executable, "-m", "odbclient.producer.producer_main", "--no-such-flag"]


@pytest.mark.timeout(60)
def test_the_supervisor_spawns_producers_without_forking_its_threaded_process() -> None:
    assert spawns_without_fork()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_insecure_port("127.0.0.1:0")
    server.start()
    exits: list[int] = []

    async def run() -> int:
        restarted = asyncio.Event()
        config = SupervisorConfig(socket="", dataset="", dataset_args=(), workers=2, job_id="t")

        async def sleep(seconds: float) -> None:  # no restart delays
            if supervisor.num_restarts >= 2:
                restarted.set()

        supervisor = _ExitsAtOnce(config, restarted.set, sleep=sleep)
        threads = _threads()
        await supervisor.start()
        await restarted.wait()
        for worker in supervisor._workers:  # each started at least twice by now
            assert worker.process is not None
            exits.append(await worker.process.wait())
        await supervisor.stop()
        return threads

    _recording.set()
    try:
        threads = uvloop.run(run())
    finally:
        _recording.clear()
        server.stop(None)
    assert threads > 1, "the test process must be threaded, as a daemon is"
    assert exits == [2, 2], "the spawned producers ran (and refused the unknown flag)"
    assert _forks == [], f"the supervisor forked a process running {_forks} threads"
