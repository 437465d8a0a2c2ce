"""odbd --collate packed vs transformers' DataCollatorWithFlattening on a CPU Llama (issue 27).

    .venv/bin/python -m tests.bench.packed_kernel_ab [--reps 5] [--size 512] \
        [--config LOADER:KERNEL[:ATTENTION]] ...

Runs `tests.bench.packed_kernel_rank` on 2 gloo ranks, alternating the configurations run by
run (by default: flatten under sdpa, flatten under odbclient's segment attention, odbd
`--attention auto` under segments, odbd under sdpa; then again), and prints the median
samples/s of each, its ratio to the first and the median of the per-rep ratios; every run's
line carries the load average before and after. Same data (every sample once), same model,
same loop; only the rows (and the attention kernel) differ. Nothing asserts: the numbers go
to docs/bench/training.md by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from tests.integration.ddp_launch import data_flags, launch_ranks, odbd_cluster

WORLD = 2


def run(  # noqa: PLR0913 - one bench run's knobs
    loader: str, out: Path, data: dict, args: argparse.Namespace, attention: str, kernel: str
) -> dict:
    model = ["--dim", str(args.dim), "--layers", str(args.layers), "--kernel", kernel]
    trainer = ["--loader", loader, "--batch", str(args.batch), *model, *data_flags(data),
               "--report", args.report]  # fmt: skip
    cluster = None
    if loader == "odbd":
        cluster = odbd_cluster(
            nodes=1, ranks_per_node=WORLD, data={**data, "label_shift": 0},
            daemon_args=["--collate", "packed", "--token-budget", str(args.budget),
                         "--buffer", str(args.buffer), "--attention", attention,
                         "--cost-model", "auto", "--cost-warmup", str(args.cost_warmup),
                         "--steps-ahead", str(args.steps_ahead)],
        )  # fmt: skip
        cluster.start()
        cluster.wait_sockets(120.0)
    try:
        ranks = launch_ranks(
            world=WORLD, nproc_per_node=WORLD, out_dir=out, trainer_args=trainer,
            sockets=cluster.sockets if cluster else None, module="tests.bench.packed_kernel_rank",
        )  # fmt: skip
        codes = ranks.wait(1800.0)
    finally:
        if cluster is not None:
            daemon_log = cluster.log(0)
            cluster.stop()
            (out / "daemon.log").write_text(daemon_log)
    if codes != [0] * WORLD:
        raise SystemExit(f"{loader} failed {codes}\n{ranks.logs()}")
    result = json.loads((out / "result.json").read_text())
    result["samples_per_s"] = result["samples"] / result["loop_s"]
    return result


DEFAULT_CONFIGS = ("flatten:sdpa", "flatten:segments", "odbd:segments:auto", "odbd:sdpa:auto")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--median-len", type=float, default=160.0)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--buffer", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--config", action="append", default=[],
        help="LOADER:KERNEL[:ATTENTION], e.g. flatten:sdpa, odbd:segments:auto (repeatable; "
        f"default {' '.join(DEFAULT_CONFIGS)}); ratios are to the first",
    )  # fmt: skip
    p.add_argument("--report", choices=["step", "forward-backward"], default="step")
    p.add_argument("--cost-warmup", type=int, default=16)
    p.add_argument("--steps-ahead", type=int, default=8)
    args = p.parse_args()
    names = args.config or list(DEFAULT_CONFIGS)
    data = {"size": args.size, "seed": 0, "vocab": 256, "median_len": args.median_len,
            "max_len": args.max_len}  # fmt: skip
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name in names:
                loader, kernel, attention = ([*name.split(":"), "auto"])[:3]
                out = Path(tmp) / f"{name.replace(':', '-')}-{rep}"
                load = os.getloadavg()[0]
                try:
                    r = run(loader, out, data, args, attention, kernel)
                except SystemExit as failed:  # a gloo rank aborted under load: once more
                    print(f"retrying {name} rep {rep}: {str(failed)[:200]}", flush=True)
                    out = Path(tmp) / f"{name.replace(':', '-')}-{rep}-retry"
                    r = run(loader, out, data, args, attention, kernel)
                r["load_before"], r["load_after"] = load, os.getloadavg()[0]
                if loader == "odbd":
                    fits = [ln for ln in (out / "daemon.log").read_text().splitlines()
                            if "cost model fitted" in ln]  # fmt: skip
                    r["last_fit"] = fits[-1].split("fitted", 1)[1] if fits else "none"
                results[name].append(r)
                print(json.dumps({"rep": rep, "name": name, **r}), flush=True)
    first = names[0]
    base = statistics.median(r["samples_per_s"] for r in results[first])
    for name in names:
        runs = results[name]
        med = statistics.median(r["samples_per_s"] for r in runs)
        steps = statistics.median(r["steps"] for r in runs)
        pairs = statistics.median(
            r["samples_per_s"] / b["samples_per_s"]
            for r, b in zip(runs, results[first], strict=True)
        )
        print(
            f"{name}: median {med:.2f} samples/s over {len(runs)} runs, {steps:.0f} steps/rank, "
            f"{med / base:.3f}x {first} (median of pair ratios {pairs:.3f}x)"
        )


if __name__ == "__main__":
    main()
