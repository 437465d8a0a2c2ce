"""Runs a command with a CPU hog on every core, as CI does with both cores busy (issue 11).

    python tests/under_load.py [--hogs N] -- COMMAND...

Starts N busy-looping processes (default: one per core), runs COMMAND, and always stops the
hogs (on success, failure, Ctrl-C or SIGTERM). Prints how long COMMAND took and exits with its
status. The tests scale their deadlines by the load average (tests/integration/harness.py:
slowdown); the hogs only reach a load of N after about a minute, so ODBD_TEST_SLOWDOWN is set
to what the load will be (1 + N per core) unless the caller set it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

HOG = "while True: pass"


def start_hogs(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(count)]


def stop_hogs(hogs: list[subprocess.Popen[bytes]]) -> None:
    for hog in hogs:
        if hog.poll() is None:
            hog.kill()
    for hog in hogs:
        hog.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="under_load", description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy processes")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.hogs < 0:
        parser.error("give the command to run after --, and --hogs >= 0")
    cores = os.cpu_count() or 1
    env = dict(os.environ)
    env.setdefault("ODBD_TEST_SLOWDOWN", f"{1 + args.hogs / cores:g}")
    hogs = start_hogs(args.hogs)
    started = time.monotonic()
    code = 1
    proc: subprocess.Popen[bytes] | None = None
    # SIGTERM (a CI cancel) is passed on as SIGINT, so pytest still runs its teardowns (stops
    # daemons, unlinks shm); then the hogs stop below. Ctrl-C reaches the command by itself.
    signal.signal(signal.SIGTERM, lambda *_: proc and proc.send_signal(signal.SIGINT))
    try:
        print(
            f"under_load: {args.hogs} CPU hogs on {cores} cores, "
            f"ODBD_TEST_SLOWDOWN={env['ODBD_TEST_SLOWDOWN']}: {' '.join(command)}",
            flush=True,
        )
        proc = subprocess.Popen(command, env=env)
        while proc.poll() is None:
            try:
                proc.wait()
            except KeyboardInterrupt:
                continue  # the command got the Ctrl-C too; wait for its clean-up
        code = proc.returncode
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        stop_hogs(hogs)
        took = time.monotonic() - started
        print(f"under_load: exit {code} after {took:.0f} s ({took / 60:.1f} min)", flush=True)
    return code if code >= 0 else 128 - code  # killed by signal N: exit 128 + N, as a shell


if __name__ == "__main__":
    sys.exit(main())
