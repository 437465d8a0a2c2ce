"""A/B of the node data path between two checkouts, alternated run by run (issue 15).

    .venv/bin/python tests/bench/datapath_ab.py --a /work/main --b . --pairs 4 [--nbytes 8192]

Each run is tests/bench/datapath_run.run_datapath executed by the checkout's own
`.venv/bin/python` from inside that checkout, so the daemon, producer and trainer all run that
checkout's code; A and B alternate (A B, B A, A B...) so load drifting on a shared machine hits
both alike. Prints one line per run and the medians: samples/s, CPU us per sample of daemon /
producer / trainer, the trainer process's CPU us per step, and B/A ratios of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

_ONE_RUN = """
import json, sys
from tests.bench.datapath_run import DatapathCase, run_datapath
nbytes, samples, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
case = DatapathCase(nbytes=nbytes, num_samples=samples, batch_samples=batch,
                    buffer=256 if nbytes <= 65536 else 64, steps_ahead=16 if nbytes <= 65536 else 8,
                    shm_bytes=(256 << 20) if nbytes <= 65536 else (512 << 20), warmup_steps=20)
run = run_datapath(case)
steps = len(run.num_samples) - case.warmup_steps - 1
print(json.dumps({
    "samples_per_s": run.samples_per_s,
    "us_per_sample": {k: v / run.window_samples * 1e6 for k, v in run.cpu_s.items()},
    "trainer_us_per_step": run.cpu_s.get("trainer", 0.0) / steps * 1e6,
}))
"""


def one_run(tree: Path, nbytes: int, samples: int, batch: int) -> dict[str, object]:
    python = tree / ".venv" / "bin" / "python"
    args = [str(python), "-c", _ONE_RUN, str(nbytes), str(samples), str(batch)]
    done = subprocess.run(args, cwd=tree, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"run in {tree} failed: {done.stderr[-3000:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="baseline checkout")
    parser.add_argument("--b", type=Path, required=True, help="candidate checkout")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--nbytes", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=30_000)
    parser.add_argument("--batch", type=int, default=16)
    options = parser.parse_args()
    results: dict[str, list[dict[str, object]]] = {"A": [], "B": []}
    for pair in range(options.pairs):
        order = ("A", "B") if pair % 2 == 0 else ("B", "A")
        for name in order:
            tree = (options.a if name == "A" else options.b).resolve()
            run = one_run(tree, options.nbytes, options.samples, options.batch)
            results[name].append(run)
            print(name, json.dumps(run), flush=True)
    medians = {}
    for name, runs in results.items():
        per_sample = [r["us_per_sample"] for r in runs]
        medians[name] = {
            "samples_per_s": statistics.median(float(r["samples_per_s"]) for r in runs),  # type: ignore[arg-type]
            "trainer_us_per_step": statistics.median(float(r["trainer_us_per_step"]) for r in runs),  # type: ignore[arg-type]
            **{
                f"{p}_us_per_sample": statistics.median(float(s.get(p, 0.0)) for s in per_sample)  # type: ignore[union-attr]
                for p in ("daemon", "producer", "trainer")
            },
        }
        print(name, "median", json.dumps({k: round(v, 1) for k, v in medians[name].items()}))
    print("B/A", json.dumps({k: round(medians["B"][k] / medians["A"][k], 3) for k in medians["A"]}))


if __name__ == "__main__":
    main()
