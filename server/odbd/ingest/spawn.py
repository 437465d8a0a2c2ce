"""Starts the daemon's producers without forking the daemon (issue 24, item 3).

The daemon runs gRPC's threads (and uvloop's). A fork() of it copies only the calling thread,
and what the child then runs before exec finds the other threads' locks and half-made updates
frozen in the copy: uvloop's fork runs Python code in the child (PyOS_AfterFork_Child, the
at-fork hooks) and gRPC's pthread_atfork handlers run there too. Producers died of it with
SIGSEGV at start-up, 7 in 62 starts of 2-node jobs (none in single-node ones, which have fewer
gRPC threads), right after gRPC's fork handler logged.

So producers are spawned, not forked: subprocess.Popen with no preexec_fn starts them with vfork
+ exec (CPython's _posixsubprocess, the way posix_spawn does it): the child shares the daemon's
memory only until exec, runs nothing but async-signal-safe system calls (setsid, closing fds,
execve), and no at-fork handler, Python's or gRPC's, runs on either side. It is also cheaper
than a fork: no copy of the daemon's page tables. The producer's end is awaited through a
pidfd on the event loop, not a thread per producer.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence


def spawns_without_fork() -> bool:
    """Whether Popen starts children with vfork here (Linux CPython; a test asserts it)."""
    return bool(getattr(subprocess, "_USE_VFORK", False)) and hasattr(os, "pidfd_open")


class SpawnedProcess:
    """A started producer: pid, returncode (None while it runs), wait(), kill()."""

    def __init__(self, popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self._popen = popen
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)  # readable once the child exited (not reaped)
        loop.add_reader(self._pidfd, self._reap, loop)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def _reap(self, loop: asyncio.AbstractEventLoop) -> None:
        # A pidfd is readable only once the child ended. poll() reaps it; None means someone
        # else reaped it first (a waitpid(-1) elsewhere): its status is lost, call it 255.
        code = self._popen.poll()
        if code is None:
            self._popen.returncode = code = 255
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        if not self._exited.done():
            self._exited.set_result(code)

    async def wait(self) -> int:
        """Its exit status (negative: the signal that ended it); any number of waiters."""
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        if self._popen.returncode is None:
            try:
                os.kill(self._popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def spawn(
    argv: Sequence[str], *, env: Mapping[str, str], new_session: bool = True
) -> SpawnedProcess:
    """Starts `argv` (vfork + exec, see the module doc) with the daemon's stdout and stderr."""
    popen = subprocess.Popen(list(argv), env=dict(env), start_new_session=new_session)
    return SpawnedProcess(popen, asyncio.get_running_loop())
