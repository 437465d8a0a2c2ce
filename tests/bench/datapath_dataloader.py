"""torch DataLoader baseline of the node data-path benchmark (issue 15, DESIGN.md section 5).

    run = run_dataloader(DataLoaderCase(nbytes=8192, num_samples=30_000, batch_samples=16,
                                        num_workers=2))

The peer a user would otherwise run: `DataLoader(FixedSizeDataset, batch_size=B, shuffle=True,
num_workers=K)` over the same samples odbd serves (tests/bench/datapath_dataset.py, a fresh
int64 array per sample), default collate (the workers stack each batch into a shared-memory
tensor and pass its handle to the main process), no pinning. The main process stands for the
trainer: it checks that every row of every batch carries its sample id and that the epoch saw
every id once, and does no compute. It runs as a child process (`python datapath_dataloader.py
run CONFIG_JSON`), so its CPU time and its K worker processes are its own; K + 1 processes are
busy. Throughput counts samples between the return of batch `warmup_steps` and the last batch,
like the odbd runs (worker start-up and the first batches are left out).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True, slots=True)
class DataLoaderCase:
    nbytes: int  # payload bytes per sample
    num_samples: int  # dataset size: one epoch
    batch_samples: int  # DataLoader batch_size
    num_workers: int  # DataLoader num_workers
    warmup_steps: int = 20  # batches left out of the measurement


@dataclass(frozen=True, slots=True)
class DataLoaderRun:
    case: DataLoaderCase
    window_samples: int  # samples after the warmup batches
    window_s: float  # return of batch warmup_steps -> return of the last batch
    main_cpu_s: float  # CPU of the main (trainer) process over the window, all its threads

    @property
    def samples_per_s(self) -> float:
        return self.window_samples / self.window_s

    @property
    def main_cpu_us_per_sample(self) -> float:
        return self.main_cpu_s / self.window_samples * 1e6


def run_dataloader(case: DataLoaderCase, timeout_s: float = 300.0) -> DataLoaderRun:
    """Runs one epoch in a child process; raises with its stderr if it fails."""
    done = subprocess.run(
        [sys.executable, __file__, "run", json.dumps(asdict(case))],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"DataLoader baseline failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return DataLoaderRun(case=case, **result)


def _run(case: DataLoaderCase) -> dict[str, float]:
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(Path(__file__).parent))
    from datapath_dataset import FixedSizeDataset

    loader = DataLoader(
        FixedSizeDataset(case.num_samples, case.nbytes),
        batch_size=case.batch_samples,
        shuffle=True,
        num_workers=case.num_workers,
        generator=torch.Generator().manual_seed(0),
    )
    seen = np.zeros(case.num_samples, np.int64)
    counts: list[int] = []
    window_start_s = window_cpu_s = 0.0
    for step, batch in enumerate(loader):
        ids = batch["input_ids"]
        first = ids[:, 0]
        if not bool((ids[:, -1] == first).all()):  # the bytes are real: both ends carry the id
            raise RuntimeError(f"batch {step}: rows do not carry their sample ids")
        seen[first.numpy()] += 1
        counts.append(int(ids.shape[0]))
        if step == case.warmup_steps:
            window_start_s, window_cpu_s = time.perf_counter(), time.process_time()
    end_s, end_cpu_s = time.perf_counter(), time.process_time()
    if not (seen == 1).all():
        raise RuntimeError("the DataLoader epoch did not yield every sample id exactly once")
    return {
        "window_samples": sum(counts[case.warmup_steps + 1 :]),
        "window_s": end_s - window_start_s,
        "main_cpu_s": end_cpu_s - window_cpu_s,
    }


if __name__ == "__main__" and sys.argv[1:2] == ["run"]:
    print(json.dumps(_run(DataLoaderCase(**json.loads(sys.argv[2])))))
