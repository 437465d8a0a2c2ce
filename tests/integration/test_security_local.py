"""Security on the node: who can reach the daemon's socket, shared memory and ports (item 6)."""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import struct
import subprocess
from pathlib import Path

import grpc
import pytest

from odbclient.framing import MAX_FRAME_BYTES, ingest_socket_path, steps_socket_path
from odbclient.wire.odbd.v1 import ingest_pb2
from tests.integration import faults_wire as wire
from tests.integration.faults_cluster import FaultCluster

pytestmark = pytest.mark.timeout(90)

LOCAL_BYTES = 16 * 1024 * 1024  # odbd.daemon.app: the unix socket's message bound


def test_socket_and_shm_segments_are_0600_and_owned_by_the_daemon_user():
    with FaultCluster(nodes=1, ranks_per_node=1, daemon_args=["--dataset-size", "10"]) as fc:
        info = os.stat(fc.cluster.sockets[0])
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600, oct(info.st_mode)
        assert info.st_uid == os.getuid()
        for beside in (steps_socket_path, ingest_socket_path):  # the framed sockets, too
            info = os.stat(beside(fc.cluster.sockets[0]))
            assert stat.S_IMODE(info.st_mode) == 0o600, (beside.__name__, oct(info.st_mode))
            assert info.st_uid == os.getuid()
        prefix = f"odbd-{fc.cluster.spec.job_id}-0-"
        segments = [p for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)]
        assert segments, "the arena has no segment"
        for path in segments:
            info = path.stat()
            assert stat.S_IMODE(info.st_mode) == 0o600, (path, oct(info.st_mode))
            assert info.st_uid == os.getuid()


def test_tcp_listeners_bind_loopback_unless_told_otherwise():
    """Node 1 gets no --listen at all; both serve /metrics on a port of their choice."""
    spec_args = ["--dataset-size", "10", "--metrics-port", "0"]
    fc = FaultCluster(nodes=2, ranks_per_node=1, daemon_args=spec_args)
    cluster = fc.cluster
    try:
        cluster.start_node(0)
        command = cluster.command(1)
        at = command.index("--listen")
        del command[at : at + 2]  # the default listener address
        log = open(cluster.log_dir / "daemon1.log", "ab")  # noqa: SIM115
        cluster.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        log.close()
        cluster.wait_sockets(60)
        fc.wait_until(lambda: fc.status(0).phase == "running", "the job formed")
        for proc in cluster.processes:
            listening = listen_addresses(proc.pid)
            assert len(listening) >= 2, listening  # peer listener and /metrics at least
            assert all(_loopback(host) for host, _ in listening), listening
    finally:
        fc.stop()


def test_oversized_messages_are_refused_and_the_daemon_stays_up():
    with FaultCluster(nodes=1, ranks_per_node=1, daemon_args=["--dataset-size", "10"]) as fc:
        channel = grpc.insecure_channel(f"unix:{fc.cluster.sockets[0]}")
        # The ingest socket's frames (protocol 7) are bounded by MAX_FRAME_BYTES: a frame that
        # announces more is refused before a byte of it is buffered.
        session = wire.FramedSession(
            ingest_socket_path(fc.cluster.sockets[0]), ingest_pb2.IngestMessage
        )
        session.send_raw(struct.pack("<I", MAX_FRAME_BYTES + 1))
        answer = session.end()
        assert answer.code is grpc.StatusCode.INVALID_ARGUMENT, answer
        assert f"at most {MAX_FRAME_BYTES}" in answer.details, answer
        answer = wire.unary(channel, wire.ADMIN, b"\x00" * (LOCAL_BYTES + 1024))
        assert answer.code is grpc.StatusCode.RESOURCE_EXHAUSTED, answer
        assert fc.status(0).phase == "running"
        channel.close()


def listen_addresses(pid: int) -> list[tuple[str, int]]:
    """(host, port) of every listening TCP socket the process holds (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A = LISTEN
                found.append(_decode_address(local, family))
    return found


def _loopback(host: str) -> bool:
    address = ipaddress.ip_address(host)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return (mapped or address).is_loopback


def _decode_address(text: str, family: socket.AddressFamily) -> tuple[str, int]:
    host_hex, port_hex = text.split(":")
    raw = bytes.fromhex(host_hex)
    # /proc prints each 32-bit word of the address in host (little-endian) byte order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw), int(port_hex, 16)
