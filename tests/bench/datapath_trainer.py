"""The trainer process of the node data-path benchmark: one rank consuming ODBClient batches.

    python tests/bench/datapath_trainer.py --socket S --out FILE [--compute-ms LO,HI]
        [--metrics-url URL --warmup-steps K]

Per step it records how long `next()` blocked (`wait_s`), the time since the previous `next()`
returned (`compute_s`, the client's own definition of the Delivered timings), when `next()`
returned, and the batch's sample count; it checks that every row of the batch carries its own
sample id at both ends (tests/bench/datapath_dataset.py fills every entry with the identity),
so the bytes are real. With `--compute-ms LO,HI` each step "trains" for a uniform random LO..HI
ms (time.sleep: like torch kernels, it releases the GIL to the client's reader thread).

With `--metrics-url`, the daemon's /metrics is scraped twice to measure pipeline overlap on the
daemon's side over the steps after warmup: once at the end of step K's compute, and once after
the epoch ended (after a short pause, so the last Delivered has landed). ODBClient reports a
step's Delivered within ~1 ms of handing it out (odbclient.trainer.reports), so by the first
scrape the reports of steps 0..K have normally landed and that of step K+1 is not made yet; the
difference covers steps K+1..last, the same steps the trainer-side numbers use.
The result is one JSON object written to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request

import torch

from odbclient import Batch, ODBClient

_COUNTERS = ("odbd_trainer_wait_seconds_total", "odbd_trainer_compute_seconds_total")
_SETTLE_S = 0.3  # after the epoch: lets the daemon apply the last Delivered before the scrape


def scrape(url: str, rank: int = 0) -> dict[str, float]:
    """The trainer wait/compute counters of `rank` from a Prometheus text page."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in _COUNTERS and f'rank="{rank}"' in rest:
            found[name] = float(rest.rsplit(" ", 1)[1])
    return found


def check_rows(batch: Batch) -> None:
    """Every row of `batch` carries its own sample id in its first and last entry.

    Its cost is the trainer's CPU too, so it reads the tensor once as numpy and compares two
    lists of ints (~2 us per 16-row step back to back; two torch slices, np.asarray and two
    np.array_equal calls were ~12 us, a sixth of the trainer thread's work per step)."""
    rows = batch["input_ids"]
    assert isinstance(rows, torch.Tensor)
    array, expected = rows.numpy(), list(batch.sample_ids)
    first, last = array[:, 0].tolist(), array[:, -1].tolist()
    if first != expected or last != expected:
        raise RuntimeError(
            f"step {batch.step}: rows carry {first[:4]} .. {last[:4]}, ids {expected[:4]}"
        )


def run(args: argparse.Namespace) -> dict[str, object]:
    lo_s, hi_s = (float(x) / 1e3 for x in args.compute_ms.split(","))
    rng = random.Random(0)
    client = ODBClient(rank=0, socket=args.socket, deadline_s=120.0)
    waits, computes, returns, samples = [], [], [], []
    scrapes: list[dict[str, float]] = []
    batches = iter(client)
    last_return_s = None
    while True:
        called_s = time.perf_counter()
        batch = next(batches, None)
        returned_s = time.perf_counter()
        if batch is None:
            break
        waits.append(returned_s - called_s)
        computes.append(0.0 if last_return_s is None else called_s - last_return_s)
        returns.append(returned_s)
        samples.append(batch.num_samples)
        check_rows(batch)
        if hi_s > 0:
            time.sleep(rng.uniform(lo_s, hi_s))
        if args.metrics_url and len(waits) == args.warmup_steps + 1:
            scrapes.append(scrape(args.metrics_url))
        last_return_s = returned_s  # the client's definition: compute includes our scrape
    if args.metrics_url:
        time.sleep(_SETTLE_S)
        scrapes.append(scrape(args.metrics_url))
    client.close()
    return {
        "wait_s": waits,
        "compute_s": computes,
        "return_s": returns,
        "num_samples": samples,
        "scrapes": scrapes,
        "summary": client.summary,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="datapath_trainer")
    p.add_argument("--socket", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--compute-ms", default="0,0", help="LO,HI simulated compute per step")
    p.add_argument("--metrics-url", default="")
    p.add_argument("--warmup-steps", type=int, default=10)
    args = p.parse_args(argv)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
