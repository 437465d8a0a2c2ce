"""Producer CPU per sample by value type: what converting Python lists costs on the hot path.

    PYTHONPATH=server:client python -m tests.bench.sample_values [--tokens 1024] [--loops 3]

Each case is one sample of `input_ids` and `labels` with --tokens int64 entries each, run through
what a producer does per sample without I/O: `fetch_sample` (dataset[i] plus `as_arrays`),
`inspect_sample` and `encode_into`. Process CPU time, best of --loops loops. The HF cases time a
real in-memory `datasets.Dataset` row fetch as well, which the producer pays whatever odbd does.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from odbclient.samples import fetch_sample, inspect_sample
from odbclient.shm import encode_into, encoded_size


def per_sample_us(dataset: Any, count: int, loops: int) -> float:
    """Best-of-`loops` CPU microseconds for fetch + inspect + encode of `count` samples."""
    buf = memoryview(bytearray(encoded_size(fetch_sample(dataset, 0)) + 4096))
    best = float("inf")
    for _ in range(loops):
        start = time.process_time()
        for i in range(count):
            sample = fetch_sample(dataset, i % len(dataset))
            inspect_sample(sample, length_key="input_ids", labels_key="labels")
            encode_into(buf, sample)
        best = min(best, time.process_time() - start)
    return best / count * 1e6


def cases(tokens: int) -> dict[str, Callable[[], Any]]:
    ids = np.arange(tokens, dtype=np.int64)

    def hf(fmt: str | None) -> Any:
        import datasets

        rows = {"input_ids": [ids.tolist()] * 64, "labels": [ids.tolist()] * 64}
        ds = datasets.Dataset.from_dict(rows)
        return ds.with_format(fmt) if fmt else ds

    return {
        "numpy arrays": lambda: [{"input_ids": ids.copy(), "labels": ids.copy()}] * 64,
        "torch tensors": lambda: (
            [{"input_ids": torch.from_numpy(ids.copy()), "labels": torch.from_numpy(ids.copy())}]
            * 64
        ),
        "Python lists": lambda: [{"input_ids": ids.tolist(), "labels": ids.tolist()}] * 64,
        "HF Dataset (lists)": lambda: hf(None),
        "HF Dataset numpy": lambda: hf("numpy"),
        "HF Dataset torch": lambda: hf("torch"),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--loops", type=int, default=3)
    args = p.parse_args()
    print(f"{args.tokens} int64 tokens per key, 2 keys ({2 * 8 * args.tokens} bytes of arrays)")
    print("| values | CPU us/sample (fetch + as_arrays + inspect + encode) |")
    print("| --- | ---: |")
    for name, build in cases(args.tokens).items():
        print(f"| {name} | {per_sample_us(build(), args.count, args.loops):.1f} |")


if __name__ == "__main__":
    main()
