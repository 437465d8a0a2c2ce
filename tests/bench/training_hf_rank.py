"""One DDP rank of the user-baselines benchmark: a random-weight tiny Llama, one epoch.

    RANK=r WORLD_SIZE=W ... (torchrun-like, see tests/integration/ddp_launch) \\
        python -m tests.bench.training_hf_rank --out-dir DIR --loader odbd|fixed|... [options]

The data is `training_text.TextTokens` (a BPE tokenizer trained on the spot). `--loader odbd`
iterates ODBClient (the daemon decides padded or packed); every other loader plans the epoch
with `training_batchers` and collates each batch itself: padded (`pad_collate`, right-padded
like odbd's default) or, with `--flatten`, transformers' `DataCollatorWithFlattening` (one
padding-free row with position_ids, HF's packing). Ranks whose plan ends first wait in DDP's
`Join`. The same per-step loop runs on a single device in tests/gpu/bench_training_gpu.py.

DIR/rank{r}.jsonl gets one line per step: ids, padded tokens (the row area the model ran),
seconds waited for the batch, seconds since the loop began, forward seconds (the rank's own
work: DDP does not synchronise in forward with `broadcast_buffers=False`), then
{"done": true, "loop_s": ...} with the wall time of the loop between two barriers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.bench import training_batchers as batchers
from tests.bench.training_text import TextTokens
from tests.integration.ddp_model import pad_collate

LOADERS = ("odbd", "fixed", "grouped", "bucketed", "balanced")


@dataclass(frozen=True)
class ModelSize:
    vocab: int = 512
    hidden: int = 64
    layers: int = 2
    heads: int = 4


def build_llama(size: ModelSize, seed: int = 0, attn: str = "sdpa") -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=2 * size.hidden,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.heads, max_position_embeddings=1024,
        attn_implementation=attn, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).train()


@dataclass(frozen=True)
class Item:
    """One rank-step's input, whatever produced it."""

    ids: list[int]
    tensors: dict[str, Any]
    loss_scale: float
    idle: bool = False


def flatten_collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_tensors="pt")
    return collator([{k: v.tolist() for k, v in s.items()} for s in samples])


def plan_for(args: argparse.Namespace, lengths: np.ndarray, world: int) -> batchers.Plan:
    common = {"world": world, "seed": args.seed}
    if args.loader == "fixed":
        return batchers.fixed(lengths, batch=args.batch_size, **common)
    if args.loader == "grouped":
        return batchers.length_grouped(lengths, batch=args.batch_size, **common)
    if args.loader == "bucketed":
        return batchers.bucketed(lengths, budget=args.token_budget, buckets=args.buckets, **common)
    return batchers.load_balanced(
        lengths, budget=args.token_budget, pool=args.pool, packed=args.flatten, **common
    )


def planned_items(dataset: TextTokens, batches: list[list[int]], flatten: bool) -> Iterator[Item]:
    collate: Callable[[Sequence[dict[str, Any]]], dict[str, Any]]
    collate = flatten_collate if flatten else pad_collate
    for ids in batches:
        samples = [dataset[i] for i in ids]
        yield Item(ids, collate(samples), 1.0)


def odbd_items(client: Any) -> Iterator[Item]:
    for batch in client:
        yield Item(list(batch.sample_ids), dict(batch.tensors), batch.loss_scale, batch.is_idle)


def padded_tokens(tensors: dict[str, Any]) -> int:
    return int(tensors["input_ids"].numel())


def run_epoch(
    model: Any,
    optimizer: torch.optim.Optimizer,
    items: Iterator[Item],
    write: Callable[[dict[str, Any]], None],
    device: str = "cpu",
) -> None:
    """The training loop every data path shares: forward, loss x scale, backward, step."""
    loop_start = time.perf_counter()
    waited = loop_start
    for step, item in enumerate(items):
        wait_s = time.perf_counter() - waited  # for the batch: the data path's own latency
        inputs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in item.tensors.items()}
        optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        loss = model(**inputs).loss
        if device != "cpu":
            torch.cuda.synchronize()
        forward_s = time.perf_counter() - started
        (loss * item.loss_scale).backward()
        optimizer.step()
        write({"epoch": 0, "step": step, "ids": item.ids, "idle": item.idle,
               "padded": 0 if item.idle else padded_tokens(item.tensors),
               "forward_s": forward_s, "wait_s": wait_s,
               "end_s": time.perf_counter() - loop_start})  # fmt: skip
        waited = time.perf_counter()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="training_hf_rank")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--loader", choices=LOADERS, required=True)
    p.add_argument("--socket", default=None, help="odbd: the daemon's socket")
    p.add_argument("--flatten", action="store_true", help="DataCollatorWithFlattening / packed")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--token-budget", type=int, default=1024)
    p.add_argument("--buckets", type=int, default=4)
    p.add_argument("--pool", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE")
    for name, default in vars(ModelSize()).items():
        p.add_argument(f"--model-{name}", type=int, default=default)
    return p.parse_args(argv)


def train_once(args: argparse.Namespace, rank: int, world: int) -> None:
    """One epoch of one data path, from a fresh model: what a run of the benchmark measures."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tests.integration.ddp_trainer import data_kwargs

    args.out_dir.mkdir(parents=True, exist_ok=True)
    size = ModelSize(**{k: getattr(args, f"model_{k}") for k in vars(ModelSize())})
    model = DistributedDataParallel(build_llama(size, args.seed), broadcast_buffers=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    client = None
    if args.loader == "odbd":
        from odbclient import ODBClient

        client = ODBClient(rank=rank, socket=args.socket, deadline_s=120.0)
        items = odbd_items(client)
    else:
        dataset = TextTokens(**data_kwargs(args.data_arg))
        plan = plan_for(args, dataset.lengths, world)
        items = planned_items(dataset, plan[rank], args.flatten)
    report = open(args.out_dir / f"rank{rank}.jsonl", "a")  # noqa: SIM115 (closed below)

    def write(record: dict[str, Any]) -> None:
        report.write(json.dumps(record) + "\n")

    try:
        dist.barrier()
        started = time.perf_counter()
        join = model.join() if client is None else contextlib.nullcontext()
        with join:
            run_epoch(model, optimizer, items, write)
        dist.barrier()
        write({"done": True, "rank": rank, "loop_s": time.perf_counter() - started})
    finally:
        report.close()
        if client is not None:
            client.close()


def next_order(schedule: Path, index: int, deadline_s: float) -> list[str] | None:
    """Rank 0 waits for the driver's order number `index` (a JSON list of flags; null: stop)."""
    path = schedule / f"order{index}.json"
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no order {path} from the benchmark driver within {deadline_s:.0f} s; the "
                "driver has died or hung: this rank stops (rerun the benchmark)"
            )
        time.sleep(0.02)
    order: list[str] | None = json.loads(path.read_text())
    return order


def main(argv: list[str] | None = None) -> int:
    """`--schedule DIR`: run order after order from the driver in one set of processes (their
    start-up, tens of seconds on a loaded 2-core machine, is paid once); else one run."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A scheduled rank may wait for its next order while the other world size runs.
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    argv = sys.argv[1:] if argv is None else argv
    try:
        if "--schedule" not in argv:
            train_once(parse_args(argv), rank, world)
            return 0
        schedule = Path(argv[argv.index("--schedule") + 1])
        for index in range(1_000_000):
            box = [next_order(schedule, index, 1800.0) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            train_once(parse_args(box[0]), rank, world)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
