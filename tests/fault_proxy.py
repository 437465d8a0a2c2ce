"""A userspace TCP fault proxy: delay, jitter, loss, stalls and partitions without netem.

The kernel on the test machines has no `sch_netem`, so network faults between daemons are made
here: every connection a client opens to the proxy's listener is forwarded to one target, and
each byte chunk is held back as the client's current `Faults` say. Faults are keyed by the
client's source host (in a network-namespace test each node has its own address), so one node
can be partitioned from the hub while the others keep going; changes apply at once, also to
open connections.

    with FaultProxy(listen=("10.77.3.254", 0), target=("10.77.3.1", 7070)) as proxy:
        proxy.set("10.77.3.3", delay_s=0.025)   # 50 ms RTT for node 2 (25 ms each way)
        proxy.set("10.77.3.3", partitioned=True)
        ...
        proxy.set("10.77.3.3", partitioned=False)

What each fault means for a TCP stream (the proxy cannot lose bytes without corrupting it):
- delay/jitter: a chunk is released `delay_s + uniform(0, jitter_s)` after it was read, but
  never before the chunk read before it (TCP keeps order).
- loss: with probability `loss`, a chunk also waits `retransmit_s` (what a dropped segment
  costs TCP: a retransmission timeout).
- partitioned: nothing passes either way (held, not discarded, as TCP retransmits); new
  connections are accepted but not forwarded until the partition heals. Held bytes flow when
  it heals; if it lasts longer than the peers' keepalive or deadlines, they give up, as they
  would on a real network.
- `reset(host)`: aborts the host's open connections (both sides see a reset).

The proxy runs its own asyncio loop in one thread; `close()` joins it.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

ANY = "*"  # faults for every client without faults of its own
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Faults:
    delay_s: float = 0.0  # one way
    jitter_s: float = 0.0
    loss: float = 0.0  # probability that a chunk waits retransmit_s more
    retransmit_s: float = 0.2
    partitioned: bool = False


@dataclass
class Traffic:
    """Bytes forwarded for one client host: `up` client -> target, `down` target -> client."""

    up: int = 0
    down: int = 0
    connections: int = 0


@dataclass
class _Link:
    host: str
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class FaultProxy:
    def __init__(self, *, listen: tuple[str, int], target: tuple[str, int], seed: int = 0) -> None:
        self._listen = listen
        self.target = target
        self._faults: dict[str, Faults] = {ANY: Faults()}
        self._traffic: dict[str, Traffic] = {}
        self._links: list[_Link] = []
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # _faults and _traffic are read by the loop thread
        self._loop = asyncio.new_event_loop()
        self._healed: dict[str, asyncio.Event] = {}
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] = ("", 0)

    # -- life cycle (any thread) ---------------------------------------------------------------

    def start(self) -> FaultProxy:
        if self._thread is not None:
            raise RuntimeError("FaultProxy.start() called twice; start it once (or use `with`)")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._server = self._loop.run_until_complete(
                    asyncio.start_server(
                        self._serve, *self._listen, family=socket.AF_INET, reuse_address=True
                    )
                )
                self.address = self._server.sockets[0].getsockname()[:2]
            except BaseException as error:  # handed to start(), which raises it
                failure.append(error)
                ready.set()
                self._loop.close()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._shutdown())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        return self

    def close(self) -> None:
        if self._thread is None:
            return
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address_str(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    # -- faults (any thread) -------------------------------------------------------------------

    def set(self, host: str = ANY, **changes: object) -> Faults:
        """Changes the faults of `host` (a client's source address, or ANY for the rest)."""
        with self._lock:
            faults = replace(self._faults.get(host, self._faults[ANY]), **changes)  # type: ignore[arg-type]
            self._faults[host] = faults
        self._loop.call_soon_threadsafe(self._wake, host)
        return faults

    def faults(self, host: str) -> Faults:
        with self._lock:
            return self._faults.get(host, self._faults[ANY])

    def traffic(self, host: str) -> Traffic:
        with self._lock:
            return replace(self._traffic.get(host, Traffic()))

    def reset(self, host: str) -> None:
        """Aborts every open connection of `host` (a reset both ways)."""
        self._loop.call_soon_threadsafe(self._abort, host)

    @contextmanager
    def partition(self, host: str) -> Iterator[None]:
        self.set(host, partitioned=True)
        try:
            yield
        finally:
            self.set(host, partitioned=False)

    # -- the loop thread ------------------------------------------------------------------------

    def _wake(self, host: str) -> None:
        for key, event in self._healed.items():
            if host in (ANY, key) and not self.faults(key).partitioned:
                event.set()

    def _abort(self, host: str) -> None:
        for link in [x for x in self._links if x.host == host]:
            for writer in (link.client, link.upstream):
                if writer is not None:
                    writer.transport.abort()

    async def _until_healed(self, host: str) -> None:
        while self.faults(host).partitioned:
            event = self._healed.setdefault(host, asyncio.Event())
            event.clear()
            await event.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host = writer.get_extra_info("peername")[0]
        link = _Link(host, writer)
        self._links.append(link)
        try:
            with self._lock:
                self._traffic.setdefault(host, Traffic()).connections += 1
            await self._until_healed(host)  # a partitioned client's SYN gets nowhere
            try:
                up_reader, link.upstream = await asyncio.open_connection(*self.target)
            except OSError:
                writer.transport.abort()
                return
            link.tasks = [
                asyncio.create_task(self._pump(host, reader, link.upstream, "up")),
                asyncio.create_task(self._pump(host, up_reader, writer, "down")),
            ]
            await asyncio.wait(link.tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in link.tasks:
                task.cancel()
            await asyncio.gather(*link.tasks, return_exceptions=True)
            for w in (writer, link.upstream):
                if w is not None:
                    w.transport.abort()
            self._links.remove(link)

    async def _pump(
        self, host: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: str
    ) -> None:
        """Copies reader to writer, each chunk released as the host's faults say, in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._release(host, queue, writer, way))
        last_due = 0.0
        try:
            while chunk := await reader.read(_CHUNK):
                faults = self.faults(host)
                due = time.monotonic() + faults.delay_s
                if faults.jitter_s:
                    due += self._random.uniform(0.0, faults.jitter_s)
                if faults.loss and self._random.random() < faults.loss:
                    due += faults.retransmit_s
                last_due = max(last_due, due)  # TCP keeps order: never overtake
                queue.put_nowait((last_due, chunk))
            queue.put_nowait((last_due, b""))  # the end of the stream, after what came before
            await sender
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)

    async def _release(
        self,
        host: str,
        queue: asyncio.Queue[tuple[float, bytes]],
        writer: asyncio.StreamWriter,
        way: str,
    ) -> None:
        while True:
            due, chunk = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._until_healed(host)
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            # Counted before the write: the write can reach the far end at once, and a reader
            # that got every byte must find them counted.
            with self._lock:
                traffic = self._traffic.setdefault(host, Traffic())
                if way == "up":
                    traffic.up += len(chunk)
                else:
                    traffic.down += len(chunk)
            writer.write(chunk)
            await writer.drain()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            for writer in (link.client, link.upstream):
                if writer is not None:
                    writer.transport.abort()
        tasks = [t for t in asyncio.all_tasks(self._loop) if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
