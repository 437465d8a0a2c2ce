"""A/B of trainer next() latency and pipeline overlap between two source trees, alternated.

    .venv/bin/python tests/bench/datapath_latency_ab.py --base /path/to/other/tree --rounds 3
        [--base-env KEY=VALUE] [--this-env KEY=VALUE]

Each round runs test_bench_datapath's LATENCY_CASE (5-10 ms of compute per step, data ready)
once with --base's code and once with this tree's (the order alternates by round), each in a
child process like tests/bench/datapath_ab.py. Prints one line per run and the medians: next()
p50 / p99 (steady state) and max, overlap from the trainer's clock and from the daemon's
/metrics, and the trainer's CPU per sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# Run as a script: its own directory is on sys.path, the repository root is not.
from datapath_ab import HERE, _env, run_tree  # type: ignore[import-not-found]

_CHILD = """
import json, sys
from tests.bench.datapath_run import percentile, run_datapath
from tests.bench.test_bench_datapath import LATENCY_CASE
run = run_datapath(LATENCY_CASE, timeout_s=300.0)
waits = run.steady_wait_s
print(json.dumps({
    "p50_ms": percentile(waits, 50) * 1e3, "p99_ms": percentile(waits, 99) * 1e3,
    "max_ms": max(waits) * 1e3, "overlap": run.trainer_overlap,
    "daemon_overlap": run.daemon_overlap or 0.0,
    "cpu_us": {k: v / run.window_samples * 1e6 for k, v in run.cpu_s.items()},
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other source tree")
    parser.add_argument("--rounds", type=int, default=3)
    for side in ("base", "this"):  # e.g. --this-env ODBCLIENT_READER=process
        parser.add_argument(f"--{side}-env", action="append", default=[], metavar="KEY=VALUE",
                            help=f"an environment variable of the {side} runs only")  # fmt: skip
    args = parser.parse_args()
    trees = {"base": args.base.resolve(), "this": HERE}
    envs = {"base": _env(args.base_env), "this": _env(args.this_env)}
    rows: dict[str, list[dict[str, object]]] = {"base": [], "this": []}
    for r in range(args.rounds):
        for name in ("base", "this") if r % 2 == 0 else ("this", "base"):
            rows[name].append(run_tree(trees[name], {}, child=_CHILD, env_extra=envs[name]))
            print(f"round {r} {name}: {json.dumps(rows[name][-1])}", flush=True)
    for name, runs in rows.items():

        def med(key: str, runs: list[dict[str, object]] = runs) -> float:
            return statistics.median(float(x[key]) for x in runs)  # type: ignore[arg-type]

        trainer = statistics.median(float(x["cpu_us"]["trainer"]) for x in runs)  # type: ignore[index]
        reader = statistics.median(float(x["cpu_us"].get("reader", 0.0)) for x in runs)  # type: ignore[attr-defined]
        worst = max(float(x["max_ms"]) for x in runs)  # type: ignore[arg-type]
        print(
            f"median {name} ({trees[name]}): next() p50 {med('p50_ms'):.3f} ms, p99 "
            f"{med('p99_ms'):.3f} ms, max {worst:.3f} ms; overlap {med('overlap'):.4f} "
            f"(daemon {med('daemon_overlap'):.4f}); trainer CPU {trainer:.1f} us/sample, its "
            f"reader process {reader:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
