"""A/B of the node data path between two source trees, alternated, with DataLoader(2 workers).

    .venv/bin/python tests/bench/datapath_ab.py --base /work/main --rounds 4 [--nbytes 8192]
        [--ring] [--base-env KEY=VALUE] [--this-env KEY=VALUE]

Each round runs, in turn: torch's DataLoader with 2 workers (with --ring, also the raw 16-slot
shared-memory ring of tests/bench/shm_ring.py: 20,000 samples at 8 KiB, 2,000 at 1 MiB), odbd
from --base, odbd from this tree (the order of the two odbd runs alternates by round), each in
a child process whose PYTHONPATH puts that tree's server/ and client/ first, so the daemon,
producer and trainer it spawns all run that tree's code. The same machine load hits every
variant of a round. Prints one line per run and the medians: samples/s, CPU us per sample
(daemon / producer / trainer), and ratios against the DataLoader (and the ring) of the same
round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
_CHILD = """
import json, sys
from tests.bench.datapath_run import DatapathCase, run_datapath
case = DatapathCase(**json.loads(sys.argv[1]))
run = run_datapath(case, timeout_s=300.0)
us = {k: v / run.window_samples * 1e6 for k, v in run.cpu_s.items()}
print(json.dumps({"samples_per_s": run.samples_per_s, "cpu_us": us}))
"""


# The trainer's reader process (ODBClient(reader="process")) is the trainer's CPU too.
_CPU_KEYS = ("daemon", "producer", "trainer", "reader", "trainer+reader")


def _env(pairs: list[str]) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in pairs)


def _case(nbytes: int) -> dict[str, object]:
    if nbytes >= 1 << 20:
        return dict(nbytes=nbytes, num_samples=5_000, batch_samples=8, buffer=64,
                    steps_ahead=8, shm_bytes=512 << 20)  # fmt: skip
    # The daemon's defaults, as test_bench_datapath's 8 KiB case (256 / 16 before issue 15's
    # third daemon pass: --buffer 256 --steps-ahead 16 runs that case).
    return dict(nbytes=nbytes, num_samples=30_000, batch_samples=16, buffer=1024,
                steps_ahead=64, shm_bytes=256 << 20)  # fmt: skip


def run_tree(
    tree: Path,
    case: dict[str, object],
    *,
    child: str = _CHILD,
    env_extra: dict[str, str] | None = None,
) -> dict[str, object]:
    """One odbd run with `tree`'s code (`child` gets `case` as JSON in argv[1] and prints its
    result as the last line of JSON); raises with the child's stderr if it fails."""
    env = {**os.environ, **(env_extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "server"), str(tree / "client"), str(HERE)])
    done = subprocess.run(
        [sys.executable, "-c", child, json.dumps(case)],
        cwd=HERE,  # the bench scripts (dataset, trainer) are this tree's
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"odbd run from {tree} failed: {done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def run_dataloader_2(case: dict[str, object]) -> float:
    sys.path.insert(0, str(HERE))
    from tests.bench.datapath_dataloader import DataLoaderCase, run_dataloader

    dl = DataLoaderCase(
        nbytes=int(case["nbytes"]),  # type: ignore[call-overload]
        num_samples=int(case["num_samples"]),  # type: ignore[call-overload]
        batch_samples=int(case["batch_samples"]),  # type: ignore[call-overload]
        num_workers=2,
    )
    return run_dataloader(dl).samples_per_s


def run_ring_16(case: dict[str, object]) -> float:
    sys.path.insert(0, str(HERE))
    from tests.bench.shm_ring import run_ring

    nbytes = int(case["nbytes"])  # type: ignore[call-overload]
    return run_ring(
        slot_bytes=nbytes, num_samples=2_000 if nbytes >= 1 << 20 else 20_000
    ).samples_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other source tree")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--nbytes", type=int, default=8192)
    parser.add_argument("--no-dataloader", action="store_true")
    parser.add_argument("--ring", action="store_true", help="also the raw 16-slot shm ring")
    parser.add_argument("--buffer", type=int, default=0, help="--buffer instead of the case's")
    parser.add_argument("--steps-ahead", type=int, default=0, help="the same for --steps-ahead")
    for side in ("base", "this"):  # e.g. --this-env ODBCLIENT_READER=process
        parser.add_argument(f"--{side}-env", action="append", default=[], metavar="KEY=VALUE",
                            help=f"an environment variable of the {side} runs only")  # fmt: skip
    args = parser.parse_args()
    case = _case(args.nbytes)
    if args.buffer:  # e.g. the case before issue 15's third daemon pass: --buffer 256
        case["buffer"] = args.buffer
    if args.steps_ahead:
        case["steps_ahead"] = args.steps_ahead
    trees = {"base": args.base.resolve(), "this": HERE}
    envs = {"base": _env(args.base_env), "this": _env(args.this_env)}
    rows: dict[str, list[dict[str, object]]] = {"base": [], "this": []}
    loader: list[float] = []
    ring: list[float] = []
    for r in range(args.rounds):
        if not args.no_dataloader:
            loader.append(run_dataloader_2(case))
            print(f"round {r} DataLoader(2 workers): {loader[-1]:,.0f} samples/s", flush=True)
        if args.ring:
            ring.append(run_ring_16(case))
            print(f"round {r} raw 16-slot ring: {ring[-1]:,.0f} samples/s", flush=True)
        for name in ("base", "this") if r % 2 == 0 else ("this", "base"):
            result = run_tree(trees[name], case, env_extra=envs[name])
            cpu = result["cpu_us"]
            assert isinstance(cpu, dict)
            cpu["trainer+reader"] = cpu.get("trainer", 0.0) + cpu.get("reader", 0.0)
            rows[name].append(result)
            print(
                f"round {r} {name}: {result['samples_per_s']:,.0f} samples/s, CPU us/sample "
                + " / ".join(f"{k} {cpu.get(k, 0):.1f}" for k in _CPU_KEYS),
                flush=True,
            )
    for name, results in rows.items():
        rate = statistics.median(float(x["samples_per_s"]) for x in results)  # type: ignore[arg-type]
        cpu = {
            k: statistics.median(float(x["cpu_us"].get(k, 0.0)) for x in results)  # type: ignore[attr-defined]
            for k in _CPU_KEYS
        }
        line = f"median {name} ({trees[name]}): {rate:,.0f} samples/s, CPU us/sample " + " / ".join(
            f"{k} {v:.1f}" for k, v in cpu.items()
        )
        if loader:
            ratios = [float(x["samples_per_s"]) / dl for x, dl in zip(results, loader, strict=True)]  # type: ignore[arg-type]
            line += (
                f"; vs DataLoader(2 workers) median {statistics.median(ratios):.2f}x "
                f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})"
            )
        if ring:
            ratios = [float(x["samples_per_s"]) / rr for x, rr in zip(results, ring, strict=True)]  # type: ignore[arg-type]
            line += (
                f"; vs the 16-slot ring median {statistics.median(ratios):.3f}x "
                f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})"
            )
        print(line, flush=True)
    if loader:
        print(f"median DataLoader(2 workers): {statistics.median(loader):,.0f} samples/s")
    if ring:
        print(f"median raw 16-slot ring: {statistics.median(ring):,.0f} samples/s")


if __name__ == "__main__":
    main()
