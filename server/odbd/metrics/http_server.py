"""The /metrics HTTP server: prometheus_client's WSGI app behind bounded threads and timeouts.

prometheus_client's start_http_server runs one thread per connection with no read timeout, so
300 clients that connect and send nothing hold 300 threads for as long as they like. Here:
  - a connection must send its request within READ_TIMEOUT_S of each read (then it is closed);
  - at most MAX_THREADS connections are served at once; one more is closed at once, unread
    (a Prometheus scrape retries at its next interval).
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

READ_TIMEOUT_S = 5.0
MAX_THREADS = 8


class _QuietHandler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # StreamRequestHandler: a socket timeout on every read and write

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        """Scrapes are not worth a log line each."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # never block the daemon's exit on a slow client
    request_queue_size = 128  # listen backlog: a burst waits for accept (closed if busy)
    max_threads = MAX_THREADS
    read_timeout_s = READ_TIMEOUT_S

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_threads)
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # busy: close it rather than start a thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or hung up is not worth a traceback on stderr."""


def start_metrics_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    *,
    max_threads: int = MAX_THREADS,
    read_timeout_s: float = READ_TIMEOUT_S,
) -> MetricsServer:
    """Binds (raises OSError) and serves /metrics from a daemon thread; stop with shutdown()."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class _Server(MetricsServer):
        address_family = family[0]

    _Server.max_threads = max_threads
    handler = type("_Handler", (_QuietHandler,), {"timeout": read_timeout_s})
    server = make_server(str(family[4][0]), port, make_wsgi_app(registry), _Server, handler)
    threading.Thread(target=server.serve_forever, name="odbd-metrics", daemon=True).start()
    return server  # type: ignore[return-value]
