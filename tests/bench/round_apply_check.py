"""The daemon's per-step and per-report Python without I/O, and a digest of what it decided.

    PYTHONPATH=<tree>/server:<tree>/client .venv/bin/python tests/bench/round_apply_check.py \
        [--samples 60000] [--repeats 5] [--buffer 1024] [--steps-ahead 64]

Drives one real RoundLoop like the bench's 8 KiB case at the daemon's defaults (1 node, 1
rank, --epochs 1, a token budget of 16 samples, fixed lengths; samples in one producer lane of
a shared-memory arena): lease and commit 256 ids at a time; whenever the units are ready,
`plan_round` them and `RoundLoop._apply` the plan (progress, StepBatches, cost expectations,
rank queues); then take every queued step as a trainer would and deliver them 4 steps per
report (RankQueue.deliver, Lanes.free, the FreeBatch message), as the live trainer reports
~15.7 times per 1,000 samples. No sockets or event loop.

Prints, per sample, the minimum over --repeats runs of `_apply` and of the reports, and a
SHA-256 over every round's plan (each unit's emitted views, slot offsets and leftover) and
every queued item's bytes: two trees that decide alike print the same digest (run it with
each tree's PYTHONPATH; the daemon's A/B of issue 15's fourth pass).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time
import uuid
from collections import deque

import numpy as np

from odbclient.wire.odbd.v1 import ingest_pb2
from odbd.config import DaemonConfig
from odbd.daemon.locations import Locations
from odbd.daemon.node_state import NodeState
from odbd.daemon.round_loop import RoundLoop
from odbd.ingest.arena import Arena
from odbd.ingest.lanes import Lanes
from odbd.metrics.stats import DaemonStats
from odbd.planner.round import plan_round
from odbd.serve.rank_queue import RankQueue
from odbd.world import World

_COMMIT_ROWS = 256  # rows per commit (the producer's --commit-batch until it became 512)
_SAMPLE_BYTES = 8200  # an 8 KiB sample and its header, as lane offsets step
_STEPS_PER_REPORT = 4  # ~64 samples per Delivered at 16 per step, as the live bench
_SCHEMA = '[["input_ids", "int64", []]]'  # set up front: no sample header to read here


def run_once(num_samples: int, buffer: int, steps_ahead: int) -> tuple[dict[str, float], str]:
    """Seconds per sample of _apply and of the reports, and the digest of what was decided."""
    config = DaemonConfig(
        world=World(1, 1), buffer=buffer, token_budget=16 * 1024, dataset_size=num_samples,
        epochs=1, steps_ahead=steps_ahead,
    )  # fmt: skip
    lane_bytes = (4 * buffer + 2 * _COMMIT_ROWS) * _SAMPLE_BYTES
    arena = Arena.create(f"bench{uuid.uuid4().hex[:8]}", 0, lane_bytes + (1 << 20))
    try:
        return _drive(config, arena, lane_bytes, num_samples)
    finally:
        arena.close()


def _drive(
    config: DaemonConfig, arena: Arena, lane_bytes: int, num_samples: int
) -> tuple[dict[str, float], str]:
    lanes = Lanes(arena, lane_bytes)
    lane = lanes.open(producer=0)
    assert lane is not None
    state = NodeState(config, num_samples)
    queue = RankQueue(0)
    loop = RoundLoop(
        config=config, state=state, barrier=None, queues={0: queue},  # type: ignore[arg-type]
        lanes=lanes, read_sample=lambda *_: memoryview(b""), on_planned=lambda _: None,
        stats=DaemonStats(node_rank=0, dataset_size=num_samples, world_size=1),
    )  # fmt: skip
    loop.filler_schema = _SCHEMA
    free = deque(range(64, lane_bytes - _SAMPLE_BYTES, _SAMPLE_BYTES))
    digest = hashlib.sha256()
    seconds = {"apply": 0.0, "reports": 0.0}
    emitted = 0
    while not loop.done:
        keys = state.lease(0, _COMMIT_ROWS, 1e9)
        if keys.size:
            n = int(keys.size)
            offsets = np.array([free.popleft() for _ in range(n)], dtype=np.int64)
            lanes.hold(lane.lane_id, offsets)
            lengths = np.full(n, 1024, np.int64)
            locations = Locations.in_lane(lane.lane_id, offsets, np.full(n, _SAMPLE_BYTES))
            state.commit(0, keys, locations, lengths, lengths, np.full(n, 7, np.int64))
        if not (state.units_ready() or keys.size == 0):
            continue
        units = sorted(state.offers(), key=lambda u: u.unit)
        planner = loop._planner([loop.cost.take_new()])
        plan = plan_round(units, planner, loop.round_index)
        for unit in plan.units:
            digest.update(unit.emitted.views.tobytes())
            digest.update(np.asarray(unit.slot_offsets, dtype=np.int64).tobytes())
            digest.update(unit.leftover.views.tobytes())
        start = time.perf_counter()
        loop._apply(plan, [])
        seconds["apply"] += time.perf_counter() - start
        loop.round_index += 1
        emitted += sum(len(u.emitted) for u in plan.units)
        start = time.perf_counter()
        for freed in _deliver_all(queue, lanes, digest):
            free.extend(freed)
        seconds["reports"] += time.perf_counter() - start
        if keys.size == 0 and plan.num_steps == 0:
            break
    return {k: s / max(emitted, 1) for k, s in seconds.items()}, digest.hexdigest()


def _deliver_all(queue: RankQueue, lanes: Lanes, digest: hashlib._Hash) -> list[list[int]]:
    """Takes every queued item as a trainer's stream would and reports the steps delivered,
    a few per report; returns the lane offsets each report handed back."""
    items = []
    while (item := queue.take_ready(prefetch=1 << 30)) is not None:
        items.append(item)
    for item in items:
        event = item.event
        digest.update(event if isinstance(event, bytes) else event.SerializeToString())
    steps = [item for item in items if item.is_step]
    back = []
    for k in range(_STEPS_PER_REPORT - 1, len(steps) + _STEPS_PER_REPORT - 1, _STEPS_PER_REPORT):
        last = steps[min(k, len(steps) - 1)]
        for offsets in lanes.free(queue.deliver(last.epoch, last.step)).values():
            ingest_pb2.IngestMessage(
                free=ingest_pb2.FreeBatch(offsets=offsets.astype("<u8").tobytes())
            )
            back.append(offsets.tolist())
    return back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=60_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--buffer", type=int, default=1024)
    parser.add_argument("--steps-ahead", type=int, default=64)
    args = parser.parse_args()

    async def runs() -> list[tuple[dict[str, float], str]]:  # RankQueue's Event wants a loop
        return [run_once(args.samples, args.buffer, args.steps_ahead) for _ in range(args.repeats)]

    results = asyncio.run(runs())
    digests = {d for _, d in results}
    assert len(digests) == 1, "the same inputs decided differently between runs"
    for phase in results[0][0]:
        print(f"{phase:8s} {min(r[phase] for r, _ in results) * 1e6:6.2f} us per sample")
    print(f"digest   {digests.pop()}")


if __name__ == "__main__":
    main()
