"""`python -m odbclient.producer.producer_main`: one producer process, as --workers spawn it.

    python -m odbclient.producer.producer_main --socket PATH --dataset MODULE:FACTORY \\
        [--dataset-arg KEY=VALUE]... [--name worker-3] [--job-id ID]

Exit status: 0 when the daemon sent Shutdown (or closed the stream), 2 when the dataset
cannot be loaded (one-line error, no traceback), 1 when the daemon refused or the stream broke.
"""

from __future__ import annotations

import argparse
import logging
import sys

from odbclient.errors import DatasetLoadError, ODBClientError
from odbclient.producer.dataset import load_dataset, parse_dataset_args
from odbclient.producer.producer import (
    DEFAULT_COMMIT_BATCH,
    DEFAULT_COMMIT_INTERVAL_S,
    DEFAULT_LEASE_BATCH,
    Producer,
)
from odbclient.shm import ShmAttachError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m odbclient.producer.producer_main",
        description="Lease sample ids from the local odbd, preprocess them with the user's "
        "dataset, and write the samples into shared memory.",
    )
    parser.add_argument(
        "--socket", help="daemon unix socket (default: $ODBD_SOCKET, else the per-user one)"
    )
    parser.add_argument("--dataset", required=True, help="MODULE:FACTORY (MODULE may be a .py)")
    parser.add_argument(
        "--dataset-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for FACTORY (repeatable; ints and floats are parsed)",
    )
    parser.add_argument("--name", help="producer name in the daemon's logs (e.g. worker-3)")
    parser.add_argument("--job-id", default="", help="refuse a daemon of another job")
    parser.add_argument(
        "--lease-batch",
        type=int,
        default=DEFAULT_LEASE_BATCH,
        help="most sample ids kept in hand (fewer when samples are slow: about 20 ms of work)",
    )
    # Why these sizes: odbclient.producer's DEFAULT_COMMIT_BATCH.
    parser.add_argument(
        "--commit-batch", type=int, default=DEFAULT_COMMIT_BATCH, help="samples per commit"
    )
    parser.add_argument(
        "--commit-interval-s",
        type=float,
        default=DEFAULT_COMMIT_INTERVAL_S,
        help="commit age limit",
    )
    parser.add_argument("--connect-timeout-s", type=float, default=60.0)
    parser.add_argument("--log-level", default="WARNING")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = args.name or "producer"
    logging.basicConfig(level=args.log_level.upper(), format=f"{name}: %(levelname)s %(message)s")
    try:
        dataset = load_dataset(args.dataset, parse_dataset_args(args.dataset_arg))
        producer = Producer(
            dataset,
            args.socket,
            name=args.name,
            job_id=args.job_id,
            lease_batch=args.lease_batch,
            commit_batch=args.commit_batch,
            commit_interval_s=args.commit_interval_s,
            connect_timeout_s=args.connect_timeout_s,
        )
        producer.run()
    except DatasetLoadError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except (ODBClientError, ShmAttachError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1
    except MemoryError as exc:
        print(f"{name}: error: {_OUT_OF_MEMORY} ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


_OUT_OF_MEMORY = (
    "out of memory: the dataset leaks or this process has a memory limit (ulimit -v, a "
    "cgroup); this producer exits so that its daemon restarts it with fresh memory (the sample "
    "it was making is made again, and quarantined as producer_crash if a fresh producer runs "
    "out of memory on it too); an external producer: restart it, and look for the leak"
)


if __name__ == "__main__":
    sys.exit(main())
