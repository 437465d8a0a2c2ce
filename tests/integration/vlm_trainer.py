"""A trainer rank that checks every multimodal batch against the dataset (issue 13).

    python -m tests.integration.vlm_trainer --rank R --socket S --report FILE --epochs E \\
        --data-arg size=N ...

For every sample of every batch it rebuilds `docs/examples/vlm_dataset.py:build(...)[id]` and
compares the sample's rows of the concatenated `pixel_values` and `image_grid_thw` (located by
`KEY_offsets`) and, packed, its slice of the one-row `input_ids` (located by cu_seq_lens_q),
byte for byte. Writes one JSON line per step: ids, per-sample lengths and patches, whether the
content matched, the shapes and the loss scale facts; then {"done": true}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from odbclient import Batch, ODBClient

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "vlm_dataset.py"


def load_dataset(pairs: list[str]) -> Any:
    spec = importlib.util.spec_from_file_location("vlm_dataset", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kwargs = {k: int(v) for k, _, v in (p.partition("=") for p in pairs)}
    return module.build(**kwargs)


def rows_of(batch: Batch, key: str, sample: int) -> np.ndarray:
    offsets = batch[f"{key}_offsets"]
    values = batch[key]
    assert not isinstance(offsets, int) and not isinstance(values, int)
    return values[int(offsets[sample]) : int(offsets[sample + 1])].numpy()


def tokens_of(batch: Batch, sample: int) -> np.ndarray:
    ids = batch["input_ids"]
    assert not isinstance(ids, int)
    if "cu_seq_lens_q" not in batch:  # padded: row `sample`, its length from the dataset
        return ids[sample].numpy()
    cu = batch["cu_seq_lens_q"]
    assert not isinstance(cu, int)
    return ids[0, int(cu[sample]) : int(cu[sample + 1])].numpy()


def check(batch: Batch, dataset: Any) -> dict[str, Any]:
    lengths, patches, matches = [], [], True
    for position, identity in enumerate(batch.sample_ids):
        want = dataset[identity]
        pixels = rows_of(batch, "pixel_values", position)
        grids = rows_of(batch, "image_grid_thw", position)
        tokens = tokens_of(batch, position)[: len(want["input_ids"])]
        matches &= bool(
            np.array_equal(pixels, want["pixel_values"])
            and np.array_equal(grids, want["image_grid_thw"])
            and np.array_equal(tokens, want["input_ids"])
        )
        lengths.append(len(want["input_ids"]))
        patches.append(int(want["pixel_values"].shape[0]))
    return {"lengths": lengths, "patches": patches, "content_ok": matches}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vlm_trainer")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    dataset = load_dataset(args.data_arg)
    client = ODBClient(rank=args.rank, socket=args.socket, deadline_s=120.0)
    try:
        with open(args.report, "a") as report:
            for _ in range(args.epochs):
                for batch in client:
                    record = {
                        "epoch": batch.epoch, "step": batch.step, "ids": list(batch.sample_ids),
                        "idle": batch.is_idle, "loss_scale": batch.loss_scale,
                        "num_tokens": batch.num_tokens,
                        "global_num_tokens": batch.global_num_tokens,
                        "keys": sorted(batch.keys()),
                        **({} if batch.is_idle else check(batch, dataset)),
                    }  # fmt: skip
                    report.write(json.dumps(record) + "\n")
            report.write(json.dumps({"done": True}) + "\n")
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
