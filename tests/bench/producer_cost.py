"""The producer's CPU per sample outside gRPC: ProducerCore making samples into a lane.

    .venv/bin/python tests/bench/producer_cost.py [--nbytes 8192] [--samples 40000]

Runs the producer's own per-sample path (ProducerCore.work_one: dataset[i], inspect, allocate,
encode into the lane, add the commit row; frees and commit batches as the daemon would cause
them) in this process, with no socket, and prints microseconds per sample against the
dataset's own `dataset[i]` timed alone over the same ids: what odbd adds on top of the user's
preprocessing. Median of --repeats alternated runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from odbclient.producer.producer import ProducerCore  # noqa: E402
from tests.bench.datapath_dataset import FixedSizeDataset  # noqa: E402


def producer_us(dataset: FixedSizeDataset, num_samples: int) -> float:
    lane = memoryview(bytearray(64 << 20))
    core = ProducerCore(
        dataset,
        lane_buffer=lane,
        lane_offset=0,
        length_key="input_ids",
        labels_key="labels",
        lease_batch=256,
        commit_batch=128,
        commit_interval_s=0.01,
    )
    ids = np.arange(num_samples, dtype=np.int64)
    started = time.process_time()
    for chunk in np.array_split(ids, max(num_samples // 128, 1)):
        core.on_grant(chunk.tolist(), chunk.tolist())
        while core.can_work():
            core.work_one(0.0)
        for message in core.commits.take():  # what the daemon frees once delivered
            if message.HasField("commit"):
                core.on_free(np.frombuffer(message.commit.offsets, "<u8").tolist())
    return (time.process_time() - started) / num_samples * 1e6


def dataset_us(dataset: FixedSizeDataset, num_samples: int) -> float:
    started = time.process_time()
    for i in range(num_samples):
        dataset[i]
    return (time.process_time() - started) / num_samples * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nbytes", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=40_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dataset = FixedSizeDataset(args.samples, args.nbytes)
    made, alone = [], []
    for _ in range(args.repeats):
        made.append(producer_us(dataset, args.samples))
        alone.append(dataset_us(dataset, args.samples))
    m, a = statistics.median(made), statistics.median(alone)
    print(
        f"{args.nbytes} B samples: producer {m:.2f} us/sample, dataset[i] alone {a:.2f}, "
        f"odbd's share {m - a:.2f} us (runs: {', '.join(f'{x:.2f}' for x in made)})"
    )


if __name__ == "__main__":
    main()
