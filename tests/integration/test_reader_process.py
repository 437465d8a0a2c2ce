"""ODBClient(reader="process"): the same batches as the reader thread, and the reader process's
faults: its death is a clear error in next(), never a hang, and it never outlives its trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from odbclient import ODBClient
from odbclient.errors import ReaderProcessError
from odbd.demo.cluster import ClusterSpec, LocalCluster
from tests.integration.harness import admin_status, poll_until, scaled, synthetic_args

pytestmark = pytest.mark.timeout(240)


def _cluster(size: int) -> LocalCluster:
    args = [*synthetic_args(size), "--token-budget", "2048", "--buffer", "32"]
    spec = ClusterSpec(
        nodes=1, ranks_per_node=1, daemon_args=["--shm-size", "64M", "--epochs", "1", *args]
    )
    return LocalCluster(spec)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _reader_pid(client: ODBClient) -> int:
    return client._stream._process.pid  # type: ignore[union-attr]


def test_reader_process_yields_the_reader_threads_batches_and_exits_on_close():
    epochs: dict[str, list[tuple[int, tuple[int, ...], dict[str, list[int]]]]] = {}
    for reader in ("thread", "process"):
        with _cluster(300) as cluster:
            cluster.wait_sockets(scaled(60))
            client = ODBClient(rank=0, socket=cluster.sockets[0], reader=reader)
            epochs[reader] = [
                (b.step, b.sample_ids, {k: list(v.shape) for k, v in b.tensors.items()})
                for b in client
            ]
            if reader == "process":
                pid = _reader_pid(client)
                assert _alive(pid)
            client.close()
            assert cluster.wait(scaled(60)) == [0]
    assert not _alive(pid), "close() ends the reader process"
    # Both readers get the daemon's deterministic plan: the same steps, samples and shapes.
    assert epochs["process"] == epochs["thread"] and len(epochs["thread"]) > 5


def test_a_dead_reader_process_is_an_error_in_next_naming_it():
    with _cluster(4000) as cluster:
        cluster.wait_sockets(scaled(60))
        client = ODBClient(rank=0, socket=cluster.sockets[0], reader="process", deadline_s=600)
        batches = iter(client)
        next(batches)
        pid = _reader_pid(client)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ReaderProcessError, match=rf"pid {pid}\) was killed by SIGKILL"):
            for _ in batches:  # the staged batches it announced first, then the error
                pass
        client.close()


_TRAINER = textwrap.dedent(
    """
    import sys, time
    from odbclient import ODBClient
    client = ODBClient(rank=0, socket=sys.argv[1], reader="process")
    batches = iter(client)
    next(batches)
    print(client._stream._process.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_the_reader_process_exits_with_its_killed_trainer(how: signal.Signals):
    with _cluster(4000) as cluster:
        cluster.wait_sockets(scaled(60))
        with subprocess.Popen(
            [sys.executable, "-c", _TRAINER, cluster.sockets[0]], stdout=subprocess.PIPE
        ) as trainer:
            try:
                assert trainer.stdout is not None
                pid = int(trainer.stdout.readline())
                assert _alive(pid)
                trainer.send_signal(how)
                trainer.wait(timeout=scaled(30))
                poll_until(lambda: not _alive(pid), "the reader process exited", scaled(30))
            finally:
                if trainer.poll() is None:
                    trainer.kill()


def test_close_lets_a_reader_process_with_unread_batches_exit_on_its_own():
    # prefetch 32: the reader process has staged and announced many batches nobody takes;
    # close() still gets its last reports and detach, and it exits 0 (not killed at the grace).
    with _cluster(4000) as cluster:
        cluster.wait_sockets(scaled(60))
        sock = cluster.sockets[0]
        client = ODBClient(rank=0, socket=sock, reader="process", prefetch=32)
        next(iter(client))
        poll_until(
            lambda: admin_status(sock).ranks[0].queued_steps >= 20, "steps queued", scaled(60)
        )
        process = client._stream._process  # type: ignore[union-attr]
        client.close()
        assert process.returncode == 0, "it exited after the detach, not killed at the grace"
