"""tests/fault_proxy.py: what passes, when, and what a partition or reset does, on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.fault_proxy import FaultProxy
from tests.integration.harness import scaled

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """A TCP echo server on 127.0.0.1 (one thread per connection, all joined at the end)."""
    server = socket.create_server(("127.0.0.1", 0))
    threads: list[threading.Thread] = []
    stopping = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        with conn:
            while data := _recv(conn):
                conn.sendall(data)

    def accept() -> None:
        while not stopping.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            thread = threading.Thread(target=serve_one, args=(conn,))
            thread.start()
            threads.append(thread)

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    try:
        yield server.getsockname()[:2]
    finally:
        stopping.set()
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        acceptor.join()
        for thread in threads:
            thread.join(timeout=10)


def _recv(conn: socket.socket) -> bytes:
    try:
        return conn.recv(65536)
    except OSError:
        return b""


def _connect(proxy: FaultProxy) -> socket.socket:
    conn = socket.create_connection(proxy.address, timeout=scaled(10))
    return conn


def _roundtrip(conn: socket.socket, payload: bytes) -> tuple[bytes, float]:
    started = time.monotonic()
    conn.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = conn.recv(65536)
        if not chunk:
            break
        got += chunk
    return got, time.monotonic() - started


def test_bytes_pass_both_ways_in_order_and_are_counted(echo):
    payload = bytes(range(256)) * 4096  # 1 MiB, many chunks
    with FaultProxy(listen=("127.0.0.1", 0), target=echo) as proxy, _connect(proxy) as conn:
        proxy.set(jitter_s=0.002)  # jitter must not reorder
        got, _ = _roundtrip(conn, payload)
        assert got == payload
        traffic = proxy.traffic("127.0.0.1")
    assert (traffic.up, traffic.down, traffic.connections) == (len(payload), len(payload), 1)


def test_delay_is_added_each_way(echo):
    with FaultProxy(listen=("127.0.0.1", 0), target=echo) as proxy, _connect(proxy) as conn:
        _, fast = _roundtrip(conn, b"x")
        proxy.set("127.0.0.1", delay_s=0.1)
        rtts = [_roundtrip(conn, b"y")[1] for _ in range(3)]
    assert min(rtts) >= 0.2, rtts  # 100 ms out and 100 ms back
    assert fast < 0.2 or min(rtts) >= fast + 0.15, (fast, rtts)


def test_a_partition_holds_bytes_until_it_heals_then_delivers_them_in_order(echo):
    with FaultProxy(listen=("127.0.0.1", 0), target=echo) as proxy, _connect(proxy) as conn:
        assert _roundtrip(conn, b"before")[0] == b"before"
        proxy.set("127.0.0.1", partitioned=True)
        conn.sendall(b"held-1")
        conn.sendall(b"held-2")
        conn.settimeout(0.5)
        with pytest.raises(TimeoutError):
            conn.recv(100)  # nothing passes while partitioned
        conn.settimeout(scaled(10))
        proxy.set("127.0.0.1", partitioned=False)
        got = b""
        while len(got) < 12:
            got += conn.recv(100)
        assert got == b"held-1held-2"


def test_a_partition_of_one_host_leaves_the_others_alone(echo):
    with FaultProxy(listen=("127.0.0.1", 0), target=echo) as proxy, _connect(proxy) as conn:
        proxy.set("127.0.0.9", partitioned=True)  # another node
        assert _roundtrip(conn, b"still")[0] == b"still"
        assert proxy.faults("127.0.0.1").partitioned is False


def test_a_new_connection_during_a_partition_is_forwarded_only_after_it_heals(echo):
    with FaultProxy(listen=("127.0.0.1", 0), target=echo) as proxy:
        proxy.set("127.0.0.1", partitioned=True)
        with _connect(proxy) as conn:
            conn.sendall(b"hello")
            conn.settimeout(0.5)
            with pytest.raises(TimeoutError):
                conn.recv(100)
            conn.settimeout(scaled(10))
            with proxy.partition("127.0.0.9"):  # healing 127.0.0.1 while another is cut
                proxy.set("127.0.0.1", partitioned=False)
                assert conn.recv(100) == b"hello"


def test_loss_costs_a_retransmission_delay_not_bytes(echo):
    with FaultProxy(listen=("127.0.0.1", 0), target=echo, seed=1) as proxy, _connect(proxy) as conn:
        proxy.set("127.0.0.1", loss=1.0, retransmit_s=0.1)
        got, rtt = _roundtrip(conn, b"lossy")
    assert got == b"lossy" and rtt >= 0.2, rtt


def test_reset_aborts_open_connections(echo):
    with FaultProxy(listen=("127.0.0.1", 0), target=echo) as proxy, _connect(proxy) as conn:
        assert _roundtrip(conn, b"up")[0] == b"up"
        proxy.reset("127.0.0.1")
        conn.settimeout(scaled(10))
        try:
            assert conn.recv(100) == b""
        except ConnectionResetError:
            pass  # an abort is a reset; either way the connection is gone


def test_close_ends_its_thread_and_open_connections(echo):
    proxy = FaultProxy(listen=("127.0.0.1", 0), target=echo).start()
    conn = _connect(proxy)
    assert _roundtrip(conn, b"a")[0] == b"a"
    proxy.close()
    assert not any(t.name == "fault-proxy" for t in threading.enumerate())
    conn.settimeout(scaled(10))
    try:
        assert conn.recv(100) == b""
    except ConnectionResetError:
        pass
    conn.close()
