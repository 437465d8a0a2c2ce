"""A light trainer stand-in for bench-scale: one process serving many ranks, one thread each.

    python tests/bench/scale_trainer.py --rank-socket 0=/tmp/n0.sock --rank-socket 1=/tmp/n1.sock

Each thread opens an ODBClient for its rank on its node's socket and takes every step as fast
as it comes (no compute), so the daemons' rounds, not training, set the pace. It runs until
its daemons end the job or go away (the bench stops them); errors then are expected and only
counted. `ODBClient(align_ranks=False)`: there is no torch process group to align over. The
repository root must be on PYTHONPATH (the bench sets it): the threads are faults_trainer's.
"""

from __future__ import annotations

import argparse
import functools
import sys

from odbclient import ODBClient
from odbclient.errors import ODBClientError
from tests.integration.faults_trainer import in_threads


def run_rank(rank: int, socket: str, epochs: int) -> None:
    try:
        client = ODBClient(rank=rank, socket=socket, align_ranks=False, deadline_s=3600.0)
    except ODBClientError:
        return
    try:
        epoch = 0
        while epochs == 0 or epoch < epochs:
            taken = 0
            for _batch in client:
                taken += 1
            if not taken:
                return  # the job ended
            epoch += 1
    except ODBClientError:
        pass  # the bench stopped the daemons
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scale_trainer")
    p.add_argument("--rank-socket", action="append", required=True, metavar="RANK=SOCKET")
    p.add_argument("--epochs", type=int, default=0, help="0: every epoch until the job ends")
    args = p.parse_args(argv)
    calls = []
    for item in args.rank_socket:
        rank, _, socket = item.partition("=")
        calls.append(functools.partial(run_rank, int(rank), socket, args.epochs))
    in_threads(calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
