"""The daemon's bookkeeping and planning per sample, without I/O: what a round costs in Python.

    PYTHONPATH=<tree>/server:<tree>/client .venv/bin/python \
        tests/bench/daemon_bookkeeping_cost.py [--samples 30000] [--repeats 6] [--commit-rows 256]

Drives one NodeState like the old 8 KiB bench case's daemon (1 node, 1 rank, --buffer 256, a
token budget of 16 samples, fixed lengths): lease --commit-rows ids (default 256, the
producer's --commit-batch), commit them as one commit of as many rows, and whenever the units
are ready take the offers, `plan_round` them, look up the emitted samples' locations and mark
them emitted. No sockets, messages, steps or event loop: the per-sample and per-round Python
of the state and the planner alone. Prints microseconds per sample by phase, the minimum over
--repeats runs (this machine is shared: the minimum is the run least disturbed). Run it with
two trees' PYTHONPATH, alternated, to compare them.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import numpy as np

from odbd.config import DaemonConfig
from odbd.daemon.locations import Locations
from odbd.daemon.node_state import NodeState
from odbd.planner.round import plan_round
from odbd.world import World

_COMMIT_ROWS = 256  # rows per commit (the producer's default --commit-batch until 512)
_SAMPLE_BYTES = 8200  # an 8 KiB sample and its header, as lane offsets step


def run_once(num_samples: int, commit_rows: int = _COMMIT_ROWS) -> dict[str, float]:
    """Seconds per sample by phase for one epoch of `num_samples` (join, 1 epoch)."""
    config = DaemonConfig(
        world=World(1, 1), buffer=256, token_budget=16 * 1024, dataset_size=num_samples,
        join=True, epochs=1,
    )  # fmt: skip
    state = NodeState(config, num_samples)
    seconds: Counter[str] = Counter()
    emitted = round_index = 0
    while emitted < num_samples - 2 * config.buffer:  # the epoch's tail rounds are partial
        start = time.perf_counter()
        keys = state.lease(0, commit_rows, 1e9)
        seconds["lease"] += time.perf_counter() - start
        if keys.size:
            n = int(keys.size)
            offsets = np.arange(64, 64 + n * _SAMPLE_BYTES, _SAMPLE_BYTES)
            lengths = np.full(n, 1024, np.int64)
            start = time.perf_counter()
            locations = Locations.in_lane(0, offsets, np.full(n, _SAMPLE_BYTES))
            state.commit(0, keys, locations, lengths, lengths, np.full(n, 7, np.int64))
            seconds["commit"] += time.perf_counter() - start
        if not state.units_ready():
            continue
        start = time.perf_counter()
        offers = state.offers()
        seconds["offers"] += time.perf_counter() - start
        start = time.perf_counter()
        plan = plan_round(offers, state.planner, round_index)
        seconds["plan_round"] += time.perf_counter() - start
        start = time.perf_counter()
        for unit in plan.units:
            state.locations_of(unit.emitted.views)
            state.mark_emitted(unit.emitted.views)
            state.return_samples(unit.unit, unit.leftover)
            emitted += len(unit.emitted)
        seconds["emit"] += time.perf_counter() - start
        round_index += 1
    seconds["total"] = sum(seconds.values())
    return {phase: s / emitted for phase, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30_000)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument(
        "--commit-rows", type=int, default=_COMMIT_ROWS, help="ids per lease, rows per commit"
    )
    args = parser.parse_args()
    runs = [run_once(args.samples, args.commit_rows) for _ in range(args.repeats)]
    for phase in runs[0]:
        print(f"{phase:10s} {min(r[phase] for r in runs) * 1e6:6.2f} us per sample")


if __name__ == "__main__":
    main()
