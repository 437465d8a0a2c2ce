"""Naming two jobs started with one --job-id on a host (issue 24; odbd.daemon.job_clash)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from odbclient.connect import connect_steps
from odbclient.errors import DaemonUnavailableError
from odbd.daemon.job_clash import OtherDaemon, clash_message, peers_of

OURS = ("10.0.0.1:7000", "10.0.0.2:7000")
THEIRS = ("10.0.0.1:7100", "10.0.0.2:7100")


def test_peers_come_from_the_command_line_then_the_environment() -> None:
    argv = ["python", "-m", "odbd", "--peers", "10.0.0.1:7100, 10.0.0.2:7100", "--node-rank", "1"]
    assert peers_of(argv, {}) == THEIRS
    assert peers_of(["odbd", "--peers=10.0.0.1:7100,10.0.0.2:7100"], {}) == THEIRS
    assert peers_of(["odbd"], {"ODBD_PEERS": "10.0.0.1:7100,10.0.0.2:7100"}) == THEIRS
    assert peers_of(["odbd"], {}) is None


def test_a_daemon_with_other_peers_is_the_other_job_and_one_with_ours_is_not() -> None:
    message = clash_message("j", OURS, [OtherDaemon(pid=42, node_rank=1, peers=THEIRS)])
    assert message.startswith("another job runs on this host with the same --job-id 'j'")
    assert "node rank 1 is held by pid 42 with --peers 10.0.0.1:7100,10.0.0.2:7100" in message
    assert "Give each job its own --job-id" in message
    assert clash_message("j", OURS, [OtherDaemon(pid=42, node_rank=1, peers=OURS)]) == ""
    assert clash_message("j", OURS, [OtherDaemon(pid=42, node_rank=1, peers=None)]) == ""
    assert clash_message("j", OURS, []) == ""


@pytest.mark.timeout(30)
def test_a_socket_file_nobody_listens_on_is_a_dead_daemon_told_at_once(tmp_path: Path) -> None:
    """A SIGKILLed daemon's socket files stay: the rank is told it died, not to start it."""
    path = str(tmp_path / "odbd.sock")
    for name in (path, path + ".steps"):
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(name)  # bound, never listening: connect() is refused, like a dead daemon's
        dead.close()
    started = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match="ran and is gone: its trainer socket"):
        connect_steps(path, timeout_s=20.0)
    assert time.monotonic() - started < 10.0
