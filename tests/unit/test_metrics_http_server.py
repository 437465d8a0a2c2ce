"""/metrics under slow clients: bounded threads, read timeouts, scrapes answered (issue 29)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from odbd.metrics.http_server import MetricsServer, start_metrics_server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    Counter("odbd_test_total", "a counter", registry=registry).inc(3)
    metrics = start_metrics_server("127.0.0.1", 0, registry, max_threads=4, read_timeout_s=0.5)
    yield metrics
    metrics.shutdown()
    metrics.server_close()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def _wait(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_scrape_is_answered(server: MetricsServer) -> None:
    assert "odbd_test_total 3.0" in _scrape(server.server_port)


def test_300_silent_clients_hold_at_most_the_thread_cap_and_time_out(
    server: MetricsServer,
) -> None:
    before = threading.active_count()
    with contextlib.ExitStack() as stack:
        clients = [
            stack.enter_context(socket.create_connection(("127.0.0.1", server.server_port)))
            for _ in range(300)
        ]
        time.sleep(0.2)  # let the server accept what it will
        peak = threading.active_count() - before
        assert peak <= 4, peak  # without the cap: one thread per client (306 measured)
        # The read timeout frees the four slots; a scrape gets through again.
        _wait(lambda: threading.active_count() - before == 0)
        assert "odbd_test_total" in _scrape(server.server_port)
        assert len(clients) == 300


def test_a_client_that_sends_half_a_request_is_dropped(server: MetricsServer) -> None:
    with socket.create_connection(("127.0.0.1", server.server_port)) as client:
        client.sendall(b"GET /metrics HTTP/1.1\r\n")  # never finishes its headers
        client.settimeout(10)
        started = time.monotonic()
        assert client.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < 5
