"""`python -m odbd.ingest.producer_guard odbclient.producer.producer_main ARGS`: a daemon-spawned
producer that dies with the daemon.

Runs `odbclient.producer.producer_main` with ARGS (named on the command line, so `ps` and the tests
still see a producer_main process) after asking the kernel to SIGKILL this process when
the daemon that spawned it exits (Linux PR_SET_PDEATHSIG; kept across exec, so this is the
producer itself). Producers run in their own session, out of reach of a terminal's Ctrl-C, so
without this a producer stuck in the user's preprocessing could outlive a SIGKILLed daemon.
The daemon passes its pid in ODBD_DAEMON_PID: if it is already gone, the producer exits at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(daemon_pid: int) -> bool:
    """Arms PR_SET_PDEATHSIG; False if the daemon is already gone (or not our parent)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return os.getppid() == daemon_pid  # not armed: still check the parent
    # Armed after the daemon died? Then the signal never comes: the parent is someone else.
    return os.getppid() == daemon_pid


_PRODUCER_MODULE = "odbclient.producer.producer_main"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != _PRODUCER_MODULE:
        print(
            f"usage: python -m odbd.ingest.producer_guard {_PRODUCER_MODULE} ARGS", file=sys.stderr
        )
        return 2
    daemon_pid = int(os.environ.get("ODBD_DAEMON_PID", "0") or 0)
    if daemon_pid and not die_with_parent(daemon_pid):
        print(f"producer: the daemon (pid {daemon_pid}) is gone; exiting", file=sys.stderr)
        return 1
    from odbclient.producer.producer_main import main as producer_main

    return producer_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
