"""A trainer process for the fault tests: one ODBClient per rank (a thread each), JSON lines out.

    python tests/integration/faults_trainer.py --socket S --ranks 0,1 --report-dir D \\
        [--epochs E] [--stop-after N --stop-how close|kill] [--state-in F] [--state-out F]

Writes D/rank<r>.jsonl (appending, so a restarted process continues the same file):
{"epoch", "step", "ids", "idle", "t"} per step; {"epoch_end", "summary"} per epoch;
{"done": true} at the end; {"error": class name, "message", "t"} when the client raised.
`--hold-s S [--hold-until FILE]` stays attached up to S seconds after the job ended (until FILE
exists), so a test can inspect the draining
daemon. `--stop-after N` leaves after N steps of this process: `close` closes the client (a clean
disconnect), `kill` SIGKILLs the whole process (a crash: nothing is flushed or closed).
Every record is flushed at once, so what a killed process wrote is what it had trained.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from odbclient import ODBClient
from odbclient.errors import ODBClientError


def _write(report, record: dict) -> None:
    report.write(json.dumps(record) + "\n")
    report.flush()


def run_rank(rank: int, args: argparse.Namespace) -> None:
    client = ODBClient(rank=rank, socket=args.socket, deadline_s=args.deadline_s)
    state_in = Path(args.state_in) if args.state_in else None
    if state_in is not None and state_in.exists():
        client.load_state_dict(json.loads(state_in.read_text()))
    steps = 0
    with open(Path(args.report_dir) / f"rank{rank}.jsonl", "a") as report:
        try:
            for _ in range(args.epochs):
                for batch in client:
                    if args.step_sleep_s:
                        time.sleep(args.step_sleep_s)
                    record = {
                        "epoch": batch.epoch,
                        "step": batch.step,
                        "ids": list(batch.sample_ids),
                        "idle": batch.is_idle,
                        "t": time.time(),
                    }
                    _write(report, record)
                    steps += 1
                    if steps == args.stop_after:
                        _stop(client, args)
                        return
                summary = client.summary
                _write(report, {"epoch_end": summary.get("epoch"), "summary": summary})
            _write(report, {"done": True})
            _hold(args)  # still attached: the daemon drains until we close
        except ODBClientError as error:
            _write(report, {"error": type(error).__name__, "message": str(error), "t": time.time()})
        finally:
            client.close()


def _hold(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.hold_s
    while time.monotonic() < deadline:
        if args.hold_until and Path(args.hold_until).exists():
            return
        time.sleep(0.05)


def _stop(client: ODBClient, args: argparse.Namespace) -> None:
    if args.state_out:
        Path(args.state_out).write_text(json.dumps(client.state_dict()))
    if args.stop_how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.stop_how == "hang":  # a rank stuck outside the loop: attached, never calls next()
        deadline = time.monotonic() + args.deadline_s
        while time.monotonic() < deadline:
            time.sleep(0.1)
    client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="faults_trainer")
    p.add_argument("--socket", required=True)
    p.add_argument("--ranks", required=True, help="comma-separated global ranks of this process")
    p.add_argument("--report-dir", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--step-sleep-s", type=float, default=0.0, help="simulated compute per step")
    p.add_argument("--stop-after", type=int, default=-1)
    p.add_argument("--stop-how", choices=("close", "kill", "hang"), default="close")
    p.add_argument("--state-in", default="")
    p.add_argument("--state-out", default="")
    p.add_argument("--deadline-s", type=float, default=120.0)
    p.add_argument("--hold-s", type=float, default=0.0, help="stay attached after the job")
    p.add_argument("--hold-until", default="", help="... or until this file exists")
    args = p.parse_args(argv)
    in_threads(functools.partial(run_rank, int(r), args) for r in args.ranks.split(","))
    return 0


def in_threads(ranks: Iterable[Callable[[], None]]) -> None:
    """Runs each rank's loop in a thread of its own (one ODBClient each), until all ended."""
    threads = [threading.Thread(target=rank) for rank in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    sys.exit(main())
