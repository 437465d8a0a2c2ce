"""Claiming the daemon's socket paths: a live daemon's refuses the start, a dead one's goes.

A daemon killed (SIGKILL, the OOM killer) leaves its socket files behind. Clients read such a
file, refused, as "the daemon ran and died" (odbclient.connect), so a daemon starting again
removes them first, before the minutes its dataset's build can take: meanwhile its clients
wait for it instead of being told it died.
"""

from __future__ import annotations

import os
import socket as socketlib
from pathlib import Path

from odbclient.framing import ingest_socket_path, steps_socket_path
from odbd.errors import ConfigError


def claim_socket_path(path: str) -> None:
    """Removes a stale socket file of a dead daemon; refuses one a live daemon answers on."""
    if not os.path.exists(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        return
    probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a dead daemon's leftover
        return
    finally:
        probe.close()
    raise ConfigError(f"another daemon is serving on {path}; stop it or pass a different --socket")


def claim_daemon_sockets(socket: str) -> None:
    """claim_socket_path for the gRPC socket and the framed sockets beside it."""
    for path in (socket, steps_socket_path(socket), ingest_socket_path(socket)):
        claim_socket_path(path)
