"""What local connections that never say hello cost a daemon (issue 29, item 6).

Starts a 1-node daemon, opens 8 connections to its ingest socket, and on each announces a
64 MiB frame and sends up to 60 MiB of it (no hello), then prints the daemon's RSS growth.
Before issue 29 the daemon buffered it all (+505 MB measured); now the first frame is bounded
by HELLO_MAX_BYTES and each connection is refused at its 4-byte length.

    .venv/bin/python -m tests.bench.prehello_rss
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from odbclient.framing import ingest_socket_path
from tests.integration.faults_cluster import FaultCluster
from tests.integration.harness import poll_until

CONNECTIONS = 8
SEND_MIB = 60


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def main() -> None:
    with FaultCluster(nodes=1, ranks_per_node=1, daemon_args=["--dataset-size", "10"]) as fc:
        pid = fc.daemons[0].pid
        poll_until(lambda: fc.status(0).phase == "running", "the daemon runs")
        before = rss_bytes(pid)
        connections, sent = [], 0
        chunk = b"\0" * (1 << 20)
        for _ in range(CONNECTIONS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(ingest_socket_path(fc.cluster.sockets[0]))
            try:
                sock.sendall(struct.pack("<I", 64 << 20))
                for _ in range(SEND_MIB):
                    sock.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass  # refused and closed by the daemon
            connections.append(sock)
        assert fc.status(0).phase == "running"  # an RPC round trip: the daemon read it all
        after = rss_bytes(pid)
        for sock in connections:
            sock.close()
    print(
        f"{CONNECTIONS} connections sent {sent >> 20} MiB before any hello; daemon RSS "
        f"{before >> 20} -> {after >> 20} MiB ({(after - before) / 1e6:+.0f} MB)"
    )


if __name__ == "__main__":
    main()
