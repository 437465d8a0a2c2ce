"""The user-baselines table of `make bench-training` on one GPU (not part of `make test`).

    .venv/bin/python -m tests.gpu.bench_training_gpu [--out docs/bench/training-gpu.md]

Needs one CUDA device; sized to finish in under 10 minutes on one current data-centre GPU
(a ~21 M-parameter random-weight Llama, 4,096 long-tailed samples, token budget 16,384, three
alternated rounds; lower `--size` if yours is slower). Same data (`training_text`, a BPE
tokenizer trained on the spot), same batchers (`training_batchers`) and the same loop
(`training_hf_rank.run_epoch`) as the CPU benchmark, in one process (world 1: the per-rank
imbalance column of the CPU table does not apply). odbd runs as a real daemon (`odbd_cluster`,
its producer process, shm) with the loop reading ODBClient in this process, padded and
`--collate packed`. With `--attn flash_attention_2` (needs flash-attn) packed rows run varlen
attention (per-sample cost); with sdpa they run a dense masked row (the row's square).

`--dry-run` runs every in-process path on CPU with a tiny model and 24 samples, one setting
each, one round, and only prints the daemon commands: the import and wiring check
`tests/unit/test_gpu_bench.py` runs in `make test`. Nothing here is collected by pytest (no
`test_` file name).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.bench import training_batchers as batchers
from tests.bench.training_hf_rank import (
    Item,
    ModelSize,
    build_llama,
    odbd_items,
    planned_items,
    run_epoch,
)
from tests.bench.training_text import TextTokens

DATA_FILE = Path(__file__).resolve().parents[1] / "bench" / "training_text.py"


@dataclass(frozen=True)
class GpuPath:
    name: str
    setting: str
    loader: str  # fixed, grouped, bucketed, balanced, odbd
    batch: int = 0
    buckets: int = 0
    pool: int = 0
    flatten: bool = False
    collate: str = "padded"  # odbd only


def paths(budget: int) -> list[GpuPath]:
    """Each baseline at two settings (the table keeps the best), odbd padded and packed."""
    return [
        *(GpuPath("DataLoader fixed batch", f"batch {b}", "fixed", batch=b) for b in (8, 32)),
        *(GpuPath("HF group_by_length", f"batch {b}", "grouped", batch=b) for b in (8, 32)),
        *(GpuPath("HF DataCollatorWithFlattening", f"batch {b}", "fixed", batch=b, flatten=True)
          for b in (8, 32)),
        *(GpuPath("token-budget buckets (Lhotse-style)", f"{n} buckets", "bucketed", buckets=n)
          for n in (4, 8)),
        *(GpuPath("cosmos-rl-style load-balanced", f"pool {p}", "balanced", pool=p)
          for p in (32, 128)),
        GpuPath("odbd padded", f"budget {budget}", "odbd"),
        GpuPath("odbd --collate packed", f"budget {budget}", "odbd", collate="packed"),
    ]  # fmt: skip


def plan(path: GpuPath, lengths: np.ndarray, budget: int) -> batchers.Plan:
    common = {"world": 1, "seed": 0}
    if path.loader == "fixed":
        return batchers.fixed(lengths, batch=path.batch, **common)
    if path.loader == "grouped":
        return batchers.length_grouped(lengths, batch=path.batch, **common)
    if path.loader == "bucketed":
        return batchers.bucketed(lengths, budget=budget, buckets=path.buckets, **common)
    return batchers.load_balanced(lengths, budget=budget, pool=path.pool, **common)


def daemon_args(path: GpuPath, budget: int, buffer: int) -> list[str]:
    return ["--token-budget", str(budget), "--buffer", str(buffer), "--collate", path.collate]


@dataclass(frozen=True)
class Result:
    path: GpuPath
    loop_s: float
    samples: int
    steps: int
    real: int
    padded: int


def run_path(
    args: argparse.Namespace, path: GpuPath, dataset: TextTokens, device: str
) -> Result | None:
    records: list[dict[str, Any]] = []
    model = build_llama(args.model, seed=0, attn=args.attn).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cluster = client = None
    items: Iterator[Item]
    if path.loader == "odbd":
        command = ["odbd", *daemon_args(path, args.budget, args.buffer)]
        if args.dry_run:
            print(f"  (dry run) {path.name}: would start {' '.join(command)} and read ODBClient")
            return None
        from odbclient import ODBClient
        from tests.integration.ddp_launch import odbd_cluster

        cluster = odbd_cluster(
            nodes=1, ranks_per_node=1, data={"size": args.size, "seed": 0},
            daemon_args=daemon_args(path, args.budget, args.buffer), dataset_file=DATA_FILE,
        )  # fmt: skip
        cluster.start()
        cluster.wait_sockets(300.0)
        client = ODBClient(rank=0, socket=cluster.sockets[0], deadline_s=300.0)
        items = odbd_items(client)
    else:
        batches = plan(path, dataset.lengths, args.budget)[0]
        items = planned_items(dataset, batches, path.flatten)
    try:
        if device != "cpu":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run_epoch(model, optimizer, items, records.append, device=device)
        if device != "cpu":
            torch.cuda.synchronize()
        loop_s = time.perf_counter() - started
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.stop()
    ids = [i for r in records for i in r["ids"]]
    assert sorted(ids) == list(range(len(dataset))), f"{path.name}: not every sample once"
    return Result(path, loop_s, len(ids), len(records), int(dataset.lengths[ids].sum()),
                  sum(r["padded"] for r in records))  # fmt: skip


def report(results: list[Result], rounds: int) -> list[str]:
    by_path: dict[GpuPath, list[Result]] = {}
    for r in results:
        by_path.setdefault(r.path, []).append(r)
    median = {p: statistics.median(x.samples / x.loop_s for x in rs) for p, rs in by_path.items()}
    best: dict[str, GpuPath] = {}
    for p in by_path:
        if p.name not in best or median[p] > median[best[p.name]]:
            best[p.name] = p
    odbd = {p.name: median[p] for p in best.values() if p.loader == "odbd"}
    lines = [
        f"| data path | setting | steps | samples/s (median of {rounds}) | tokens/s | padding "
        "| odbd padded vs it | odbd packed vs it |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, p in best.items():
        r = by_path[p][0]
        rate = median[p]
        ratios = [f"{odbd[k] / rate:.2f}x" if k in odbd else "-"
                  for k in ("odbd padded", "odbd --collate packed")]  # fmt: skip
        lines.append(
            f"| {name} | {p.setting} | {r.steps} | {rate:,.0f} "
            f"| {rate * r.real / r.samples:,.0f} | {100 * (1 - r.real / r.padded):.1f} % "
            f"| {' | '.join(ratios)} |"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_training_gpu", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, no daemon")
    p.add_argument("--size", type=int, default=4096, help="samples per epoch")
    p.add_argument("--budget", type=int, default=16384, help="token budget (odbd, buckets, pools)")
    p.add_argument("--buffer", type=int, default=256, help="odbd --buffer")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds; medians")
    p.add_argument("--attn", default="sdpa", help="sdpa or flash_attention_2")
    p.add_argument("--out", type=Path, default=None, help="append the table to this file")
    args = p.parse_args(argv)
    args.model = ModelSize(vocab=512, hidden=512, layers=8, heads=8)
    if args.dry_run:
        args.size, args.budget, args.buffer, args.rounds = 24, 256, 16, 1
        args.model = ModelSize(vocab=512, hidden=16, layers=1, heads=2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this script measures one GPU; use --dry-run to check it on CPU")
        return 2
    dataset = TextTokens(size=args.size, seed=0)
    started = time.perf_counter()
    results: list[Result] = []
    todo = paths(args.budget)
    if args.dry_run:  # one setting per path: a wiring check, not a sweep
        todo = [p for i, p in enumerate(todo) if p.name not in {q.name for q in todo[:i]}]
    for round_index in range(args.rounds):
        for path in todo:
            result = run_path(args, path, dataset, device)
            if result is not None:
                results.append(result)
                print(f"  round {round_index}: {path.name} [{path.setting}] "
                      f"{result.samples / result.loop_s:,.0f} samples/s")  # fmt: skip
    lines = report(results, args.rounds)
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    header = f"{name}, {args.size} samples, {args.model}, budget {args.budget}, attn {args.attn}"
    print("\n".join([header, "", *lines]))
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.out is not None:
        with args.out.open("a") as f:
            f.write("\n".join(["", f"## GPU: {header}", "", *lines]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
