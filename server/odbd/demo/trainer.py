"""A simulated trainer rank for the demo and the tests: consumes ODBClient batches.

Each step "trains" for the cost model's time of its own batch (c + a*padded + b*sum l^2
token-equivalents, times --seconds-per-token) and appends one JSON line per step to --report:
{"epoch", "step", "ids", "idle", "padded", "loss_scale", "num_tokens", "global_num_samples"}.
An epoch's end adds {"epoch_end": epoch, "summary": {...}}; the end of the job {"done": true}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from odbclient import ODBClient


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="odbd-demo-trainer")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seconds-per-token", type=float, default=0.0)
    p.add_argument("--cost", default="1,1.2e-5,1800", help="a,b,c of the cost model")
    p.add_argument("--stop-after", type=int, default=-1, help="exit after this many steps")
    p.add_argument("--state-in", default="")
    p.add_argument("--state-out", default="")
    args = p.parse_args(argv)
    a, b, c = (float(x) for x in args.cost.split(","))
    client = ODBClient(rank=args.rank, socket=args.socket, deadline_s=120.0)
    if args.state_in:
        with open(args.state_in) as f:
            client.load_state_dict(json.load(f))
    steps = 0
    with open(args.report, "a") as report:
        for _ in range(args.epochs):
            for batch in client:
                ids = batch["input_ids"]
                assert not isinstance(ids, int)  # input_ids is always a tensor
                padded = 0 if batch.is_idle else int(ids.shape[0] * ids.shape[1])
                # Sample lengths are not in the batch; b * B * maxlen^2 bounds b * sum l^2.
                sum_sq = float(ids.shape[0]) * float(ids.shape[1]) ** 2 if padded else 0.0
                if args.seconds_per_token:
                    time.sleep((c + a * padded + b * sum_sq) * args.seconds_per_token)
                record = {
                    "epoch": batch.epoch,
                    "step": batch.step,
                    "ids": list(batch.sample_ids),
                    "idle": batch.is_idle,
                    "padded": padded,
                    "loss_scale": batch.loss_scale,
                    "num_tokens": batch.num_tokens,
                    "global_num_samples": batch.global_num_samples,
                }
                report.write(json.dumps(record) + "\n")
                report.flush()
                steps += 1
                if steps == args.stop_after:
                    if args.state_out:
                        with open(args.state_out, "w") as f:
                            json.dump(client.state_dict(), f)
                    client.close()
                    return 0
            end = {"epoch_end": client.summary.get("epoch"), "summary": client.summary}
            report.write(json.dumps(end) + "\n")
            report.flush()
        report.write(json.dumps({"done": True}) + "\n")
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
