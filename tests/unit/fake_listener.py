"""A unix-socket listener for the fake daemons of the client and producer tests: it accepts
every connection on its own thread and runs `serve(connection)` there; close() stops
accepting and joins every thread it started (the no_leaks fixture would name them)."""

from __future__ import annotations

import socket as socketlib
import threading
from collections.abc import Callable


class FakeListener:
    def __init__(
        self, path: str, name: str, serve: Callable[[socketlib.socket], None], join_s: float
    ) -> None:
        self._name = name
        self._serve = serve
        self._join_s = join_s
        self.listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen()
        self.threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, name=f"{name}-accept")
        self._accepting.start()

    def close(self) -> None:
        self.listener.shutdown(socketlib.SHUT_RDWR)
        self.listener.close()
        self._accepting.join(timeout=10)
        for thread in self.threads:
            thread.join(timeout=self._join_s)
            assert not thread.is_alive(), f"{thread.name} still runs"

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return  # closed
            thread = threading.Thread(target=self._serve, args=(connection,), name=self._name)
            self.threads.append(thread)
            thread.start()
