"""A torchrun rank for test_rewind.py: checkpoints `client.state_dict()`, is SIGKILLed by plan,
and torchrun --max-restarts starts every rank again from the last checkpoint, against the
daemons that kept running (issue 23).

Rank r talks to node r's daemon (ODBD_SOCKETS: one socket per rank, comma separated, one rank
per node). Every step runs one all_reduce (DDP's gradient all_reduce: every rank must be in it).
After step (epoch, step) in --save-at, each rank writes its state_dict to OUT/ckpt{r}.json
(atomically, after the all_reduce, so both ranks hold the same point); step -1 saves after the
epoch's loop ended. A --kill entry [run, rank, epoch, step] SIGKILLs that rank of that run
(TORCHELASTIC_RESTART_COUNT) right after it trained that step (-1: after the epoch's loop).
Each trained step is a line of OUT/rank{r}.run{n}{tag}.jsonl: {"epoch", "step", "ids",
"data": sums of the batch's input_ids and labels}; the first
line of a run says what it loaded: {"loaded": state or null}; a step's line also holds its
job_fraction. --until-job-end loops until the job ends (odbd --epochs 0 with --max-updates or
end_job()); --end-at [run, epoch, step] calls end_job() after that step of that run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from odbclient import ODBClient
from tests.integration.restart_align_train import init_process_group


def save(out: Path, rank: int, client: ODBClient) -> None:
    path = out / f"ckpt{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(client.state_dict()))
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--save-at", type=json.loads, default=[])  # [[epoch, step], ...]
    parser.add_argument("--kill", type=json.loads, default=[])  # [[run, rank, epoch, step]]
    parser.add_argument("--step-s", type=float, default=0.0)  # a slow step (compute)
    parser.add_argument("--pg-timeout-s", type=float, default=60.0)
    parser.add_argument("--tag", default="")  # names this launch's record files
    # an endless job (odbd --epochs 0 --max-updates N): loop until the job ends, whatever
    # --epochs says; --end-at [[run, epoch, step]]: end_job() right after that step (every rank)
    parser.add_argument("--until-job-end", action="store_true")
    parser.add_argument("--end-at", type=json.loads, default=[])
    args = parser.parse_args()
    init_process_group(timedelta(seconds=args.pg_timeout_s))
    rank, run = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    sockets = os.environ["ODBD_SOCKETS"].split(",")
    # prefetch 2: each step is reported delivered at once, so a kill lands after the daemon
    # freed the steps since the checkpoint (a rewind, not a re-send of unreported steps)
    client = ODBClient(rank=rank, socket=sockets[rank], prefetch=2)
    ckpt = args.out_dir / f"ckpt{rank}.json"
    loaded = json.loads(ckpt.read_text()) if ckpt.exists() else None
    if loaded is not None:
        client.load_state_dict(loaded)
    saves = {tuple(point) for point in args.save_at}
    kills = {(e, s) for r, k, e, s in args.kill if r == run and k == rank}
    records = (args.out_dir / f"rank{rank}.run{run}{args.tag}.jsonl").open("a")
    records.write(json.dumps({"loaded": loaded}) + "\n")
    records.flush()
    end_at = {(e, s) for r, e, s in args.end_at if r == run}
    epoch = client.epoch
    while (epoch < args.epochs or args.until_job_end) and not client.job_ended:
        for batch in client:
            in_step = torch.tensor([float(batch.step)])
            dist.all_reduce(in_step)
            if args.step_s:
                time.sleep(args.step_s)
            ids = [int(i) for i in batch.sample_ids]
            # what the shared memory held: a rewound step's samples lie at new locations
            data = [int(batch["input_ids"].sum()), int(batch["labels"].sum())] if ids else []
            record = {"epoch": batch.epoch, "step": batch.step, "ids": ids, "data": data,
                      "fraction": batch.progress.job_fraction}  # fmt: skip
            records.write(json.dumps(record))
            records.write("\n")
            records.flush()
            if (batch.epoch, batch.step) in saves:
                save(args.out_dir, rank, client)
            if (batch.epoch, batch.step) in kills:
                os.kill(os.getpid(), signal.SIGKILL)
            if (batch.epoch, batch.step) in end_at:
                client.end_job()
                break
        if (epoch, -1) in saves:
            save(args.out_dir, rank, client)
        if (epoch, -1) in kills:
            os.kill(os.getpid(), signal.SIGKILL)
        epoch += 1
    client.close()
    records.write(json.dumps({"done": True}) + "\n")
    records.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
