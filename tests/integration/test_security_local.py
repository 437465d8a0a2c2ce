"""Security on the node: who can reach the daemon's socket, shared memory and ports (item 6)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

from odbclient.framing import MAX_FRAME_BYTES, ingest_socket_path, steps_socket_path
from odbclient.wire.odbd.v1 import ingest_pb2, trainer_pb2
from odbd.framed_socket import HELLO_MAX_BYTES
from tests.integration import faults_wire as wire
from tests.integration.faults_cluster import FaultCluster
from tests.integration.harness import poll_until, scaled

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
        # The ingest socket's frames (protocol 7) are bounded by MAX_FRAME_BYTES, and a first
        # frame (the hello) by HELLO_MAX_BYTES (issue 29): a frame that announces more is
        # refused before a byte of it is buffered.
        session = wire.FramedSession(
            ingest_socket_path(fc.cluster.sockets[0]), ingest_pb2.IngestMessage
        )
        session.send_raw(struct.pack("<I", MAX_FRAME_BYTES + 1))
        answer = session.end()
        assert answer.code is grpc.StatusCode.INVALID_ARGUMENT, answer
        assert f"at most {HELLO_MAX_BYTES} before the peer's hello" in answer.details, answer
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


# -- local trust (issue 29) ------------------------------------------------------------------

NOBODY = 65534

# A socket server run as another user: it binds the step and ingest sockets beside PATH,
# prints "ready", counts the connections and bytes it receives until its stdin closes, then
# prints them. No thread: one select loop.
SQUATTER = r"""
import os, select, socket, sys
path = sys.argv[1]
listeners = []
for name in (path + ".steps", path + ".ingest"):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(name)
    s.listen(8)
    listeners.append(s)
print("ready", os.getuid(), flush=True)
conns, received, accepted = [], 0, 0
while True:
    ready, _, _ = select.select([sys.stdin, *listeners, *conns], [], [], 10)
    if not ready:
        break
    for r in ready:
        if r is sys.stdin:
            if not sys.stdin.readline():
                for s in listeners:  # connections still in the backlog count too
                    s.setblocking(False)
                    while True:
                        try:
                            conns.append(s.accept()[0])
                        except OSError:
                            break
                        accepted += 1
                for c in conns:
                    c.setblocking(False)
                    try:
                        received += len(c.recv(1 << 20))
                    except OSError:
                        pass
                print(f"connections={accepted} bytes={received}", flush=True)
                sys.exit(0)
        elif r in listeners:
            conns.append(r.accept()[0])
            accepted += 1
        else:
            data = r.recv(1 << 20)
            received += len(data)
            if not data:
                conns.remove(r)
"""


def _as_nobody() -> None:
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _python_for_nobody() -> str:
    """A Python that uid nobody may run (the venv's interpreter may sit under /root)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and os.stat(candidate).st_mode & 0o001:
            return candidate
    pytest.skip("no world-executable python3 to run a process as another user")


@pytest.mark.parametrize("case", ["socket-owner", "listener-uid", "listener-uid-reader-process"])
def test_a_trainer_and_a_producer_refuse_a_socket_of_another_user_before_sending_anything(case):
    """Issue 29 item 4: another user binds the daemon's path first. The trainer and the
    producer refuse it, naming the path and the uid, and the squatter receives 0 bytes.
    "listener-uid": the socket file is root's (as if chowned), so only SO_PEERCRED shows it;
    with reader="process" the reader process connects, and its refusal reaches the trainer."""
    from odbclient import ODBClient, Producer
    from odbclient.errors import UntrustedDaemonError

    home = Path(tempfile.mkdtemp(prefix="odbd-theirs-"))  # tmp_path's parents are 0700
    os.chown(home, NOBODY, NOBODY)
    path = str(home / "odbd.sock")
    squatter = subprocess.Popen(
        [_python_for_nobody(), "-c", SQUATTER, path],
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=_as_nobody,
    )
    try:
        assert squatter.stdout is not None and squatter.stdin is not None
        assert squatter.stdout.readline().split() == ["ready", str(NOBODY)]
        if case.startswith("listener-uid"):
            for name in (steps_socket_path(path), ingest_socket_path(path)):
                os.chown(name, 0, 0)
        expected = rf"{path}\.steps .*uid {NOBODY}.*sent nothing"
        reader = "process" if case.endswith("reader-process") else "thread"
        client = ODBClient(rank=0, socket=path, connect_timeout_s=scaled(10), reader=reader)
        with pytest.raises(UntrustedDaemonError, match=expected):
            iter(client)
        client.close()
        with pytest.raises(UntrustedDaemonError, match=rf"{path}\.ingest .*uid {NOBODY}"):
            Producer([{"input_ids": [1]}], socket=path, connect_timeout_s=scaled(10)).run()
        squatter.stdin.close()
        counts = squatter.stdout.readline().split()
        squatter.wait(timeout=scaled(10))
    finally:
        if squatter.poll() is None:
            squatter.kill()
            squatter.wait()
        for pipe in (squatter.stdin, squatter.stdout):
            if pipe is not None:
                pipe.close()
        shutil.rmtree(home, ignore_errors=True)
    connections = 0 if case == "socket-owner" else 2  # a file of theirs: never connected
    assert counts == [f"connections={connections}", "bytes=0"]


def test_the_daemon_refuses_a_peer_of_another_user():
    """A file-mode mistake (the socket made 0666) still lets no other uid in: SO_PEERCRED."""
    with FaultCluster(nodes=1, ranks_per_node=1, daemon_args=["--dataset-size", "10"]) as fc:
        steps = steps_socket_path(fc.cluster.sockets[0])
        os.chmod(fc.cluster.tmp, 0o711)
        os.chmod(steps, 0o666)
        code = (
            "import socket, sys; s = socket.socket(socket.AF_UNIX); s.settimeout(30); "
            "s.connect(sys.argv[1]); data = b''\n"
            "while (chunk := s.recv(65536)): data += chunk\n"
            "sys.stdout.buffer.write(data)"
        )
        out = subprocess.run(
            [_python_for_nobody(), "-c", code, steps],
            cwd="/",
            capture_output=True,
            preexec_fn=_as_nobody,
            timeout=scaled(60),
        )
        assert out.returncode == 0, out.stderr
        assert b"PERMISSION_DENIED" in out.stdout, out.stdout
        assert f"uid {NOBODY} may not use this daemon".encode() in out.stdout, out.stdout
        assert f"runs as uid {NOBODY}, not as the daemon's user" in fc.log(0)
        assert fc.status(0).phase == "running"


def test_pre_hello_bytes_and_waiting_connections_are_bounded():
    """Issue 29 item 6: before its hello a local connection may make the daemon buffer one
    small frame (it buffered up to 64 MiB each: 8 connections, +474 MB), and at most
    MAX_UNGREETED connections may wait for their hello at once."""
    from odbd.framed_socket import MAX_UNGREETED

    with FaultCluster(nodes=1, ranks_per_node=1, daemon_args=["--dataset-size", "10"]) as fc:
        pid = fc.daemons[0].pid
        ingest = ingest_socket_path(fc.cluster.sockets[0])
        before = _rss_bytes(pid)
        announced = 60 << 20
        for _ in range(8):
            session = wire.FramedSession(ingest, ingest_pb2.IngestMessage)
            session.send_raw(struct.pack("<I", announced) + b"\0" * (8 << 20))
            answer = session.end()
            assert answer.code is grpc.StatusCode.INVALID_ARGUMENT, answer
            assert f"announces {announced} bytes (at most {HELLO_MAX_BYTES}" in answer.details
        grown = _rss_bytes(pid) - before
        assert grown < 32 << 20, f"the daemon grew {grown >> 20} MiB"
        silent = []
        baseline = _socket_fds(pid)
        try:
            for _ in range(MAX_UNGREETED):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(steps_socket_path(fc.cluster.sockets[0]))
                silent.append(sock)
            fc.wait_until(
                lambda: _socket_fds(pid) >= baseline + MAX_UNGREETED, "the daemon accepted all"
            )
            one_more = wire.FramedSession(ingest, ingest_pb2.IngestMessage)
            answer = one_more.end()
            # The ingest socket is its own server: its count is separate (a producer can
            # still connect while trainers' connections wait).
            assert answer.code is not grpc.StatusCode.RESOURCE_EXHAUSTED, answer
            one_more = wire.FramedSession(
                steps_socket_path(fc.cluster.sockets[0]), trainer_pb2.TrainerEvent
            )
            answer = one_more.end()
            assert answer.code is grpc.StatusCode.RESOURCE_EXHAUSTED, answer
            assert f"(at most {MAX_UNGREETED})" in answer.details, answer
        finally:
            for sock in silent:
                sock.close()
        assert fc.status(0).phase == "running"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _socket_fds(pid: int) -> int:
    """The process's open sockets (each accepted connection is one)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:
            continue
    return count


@pytest.mark.parametrize("victim", ["missing", "empty"])
def test_a_daemon_with_a_symlinked_journal_refuses_it_and_creates_nothing(tmp_path, victim):
    """Issue 29 item 3: another user plants node0.journal -> a file in a root-only directory;
    the daemon used to create it (or overwrite an empty one and chmod it 0600)."""
    state, private = tmp_path / "state", tmp_path / "root-only"
    state.mkdir(mode=0o700)
    private.mkdir(mode=0o700)
    target = private / "victim"
    if victim == "empty":
        target.write_bytes(b"")
        target.chmod(0o644)
    link = state / "node0.journal"
    link.symlink_to(target)
    before = target.stat() if target.exists() else None
    job_id = f"symlinked-journal-{victim}"
    socket_path = tmp_path / "s.sock"
    args = ["--world", "1", "--nproc-per-node", "1", "--dataset-size", "5", "--job-id", job_id]
    args += ["--state-dir", str(state)]
    proc = subprocess.run(
        [sys.executable, "-m", "odbd", "--socket", str(socket_path), *args],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode != 0, proc.stderr
    assert f"the --state-dir journal {link} is a symbolic link" in proc.stderr, proc.stderr
    assert "nothing was opened or created" in proc.stderr
    assert sorted(os.listdir(private)) == (["victim"] if before else [])
    if before is not None:
        after = target.stat()
        assert (after.st_size, after.st_mode, after.st_mtime_ns) == (
            before.st_size,
            before.st_mode,
            before.st_mtime_ns,
        )
    assert sorted(os.listdir(state)) == ["node0.journal"]
    assert not socket_path.exists()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"odbd-{job_id}-")]


def test_the_default_socket_lives_in_a_private_directory_and_a_squatted_one_is_refused(
    tmp_path, monkeypatch
):
    """Issue 29 item 4: not bare /tmp/odbd-$UID.sock, which another user could bind first.
    The daemon creates $XDG_RUNTIME_DIR/odbd mode 0700 (or /tmp/odbd-$UID), refuses one that
    someone else owns, and a trainer given no socket finds the daemon there."""
    from odbclient import ODBClient

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("ODBD_SOCKET", raising=False)
    job_id = "default-socket"
    command = [sys.executable, "-m", "odbd", "--world", "1", "--nproc-per-node", "1"]
    command += ["--dataset-size", "5", "--job-id", job_id, "--epochs", "0"]
    private = runtime / "odbd"
    private.mkdir(mode=0o700)
    os.chown(private, NOBODY, NOBODY)  # another user made it first
    proc = subprocess.run(command, capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 2, proc.stderr
    assert f"--socket: directory {private} is owned by another user" in proc.stderr
    assert f"owner uid {NOBODY}" in proc.stderr and f"chmod 700 {private}" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert os.listdir(private) == []
    private.rmdir()
    log = open(tmp_path / "daemon.log", "wb")  # noqa: SIM115
    daemon = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        poll_until(lambda: (private / "odbd.sock").exists(), "the daemon bound its socket")
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert private.stat().st_uid == os.getuid()
        client = ODBClient(rank=0, connect_timeout_s=scaled(30))  # no socket: the default
        try:
            iter(client)  # welcomed (no producers run, so no batch)
            assert client.socket == str(private / "odbd.sock")
        finally:
            client.close()
    finally:
        daemon.terminate()
        daemon.wait(timeout=scaled(60))
    assert daemon.returncode == 0, (tmp_path / "daemon.log").read_text()
    assert not (private / "odbd.sock").exists()
