"""A torchrun rank for test_torchrun_restart.py: the first runs fail, torchrun restarts every rank.

In run n < len(FAIL_RUNS) (TORCHELASTIC_RESTART_COUNT), rank r takes FAIL_RUNS[n][r] batches
(a count, "epoch": the rest of its epoch, "job": every batch), closes its client (so the
daemon has its Delivered reports, as when ranks die with some still unsent) and exits 1 after a
barrier, so torchrun restarts every rank. The last run loads no state_dict (the user saved
none); each rank iterates the epochs with one all_reduce per step, as DDP does, and writes what
it took to OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from odbclient import Batch, ODBClient


def init_process_group(timeout: timedelta) -> None:
    """gloo over torchrun's store, under a prefix of its own per restart: without it, restarted
    ranks of torch 2.13 can read the addresses their predecessors published there and fail
    with "Connection refused" (pytorch/pytorch#167288 is the same under NCCL), odbd or not."""
    env = os.environ
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    attempt = dist.PrefixStore(f"restart{env['TORCHELASTIC_RESTART_COUNT']}/", store)
    dist.init_process_group("gloo", store=attempt, rank=rank, world_size=world, timeout=timeout)


def batches(client: ODBClient, epochs: int) -> Iterator[tuple[int, Batch]]:
    """(epoch loop, batch) over `epochs` loops of `for batch in client`."""
    for loop in range(epochs):
        for batch in client:
            yield loop, batch


def fail_after(client: ODBClient, epochs: int, take: int | str) -> None:
    loops = 1 if take == "epoch" else epochs
    for taken, _ in enumerate(batches(client, loops), start=1):
        if taken == take:
            break
    client.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--fail-runs", type=json.loads, required=True)
    parser.add_argument("--pg-timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    init_process_group(timedelta(seconds=args.pg_timeout_s))
    rank = dist.get_rank()
    client = ODBClient(rank=rank)
    run = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if run < len(args.fail_runs):
        fail_after(client, args.epochs, args.fail_runs[run][rank])
    taken: list[list[int]] = []
    for loop, batch in batches(client, args.epochs):
        in_step = torch.tensor([float(batch.step)])
        dist.all_reduce(in_step)  # DDP's gradient all_reduce: every rank must be in it
        taken.append([loop, batch.epoch, batch.step, *batch.sample_ids])
    client.close()
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(taken))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
