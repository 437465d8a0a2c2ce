"""One DDP rank of the packed-kernel bench (issue 27): a CPU Llama on packed rows.

    RANK=r WORLD_SIZE=W ... ODBD_SOCKET=... python -m tests.bench.packed_kernel_rank \\
        --loader odbd|flatten --out-dir DIR --data-arg key=value ...

Both loaders feed one padding-free row per rank-step to the same random-init transformers
Llama (float32, sdpa, no KV cache), through the same loop: forward and backward under no
gradient sync, timed and (odbd) reported with `ODBClient.report_compute`, then one all-reduce
of the flat gradient and an AdamW step. Only the rows differ:

- flatten: `DistributedSampler` (shuffled) + `DataLoader(batch_size=B, collate_fn=
  transformers.DataCollatorWithFlattening())`, HF's padding-free collator (B samples a row);
- odbd: `ODBClient` batches of `odbd --collate packed` (the loss times `loss_scale`).

Rank 0 writes DIR/result.json: the loop's wall time between barriers, steps, samples, tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.integration.ddp_data import LongTailTokens


def build_llama(dim: int, layers: int, vocab: int, kernel: str = "sdpa") -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    if kernel == "segments":
        from odbclient.trainer.segment_attention import register_segment_attention

        kernel = register_segment_attention()

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=max(dim // 64, 1), num_key_value_heads=max(dim // 64, 1),
        max_position_embeddings=8192, attn_implementation=kernel, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def flatten_rows(dataset: LongTailTokens, batch: int, rank: int, world: int) -> Any:
    from transformers import DataCollatorWithFlattening

    sampler = torch.utils.data.DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=0
    )
    collator = DataCollatorWithFlattening(return_tensors="pt")
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch, sampler=sampler, collate_fn=collator, num_workers=0
    )
    for inputs in loader:
        yield inputs, 1.0, None


def odbd_rows(client: Any) -> Any:
    for batch in client:
        yield batch.tensors, batch.loss_scale, batch


def allreduce_cost(numel: int) -> float:
    """Seconds of one all-reduce of `numel` float32 without waiting for a late rank: each of
    5 tries starts right after a barrier, and the fastest counts."""
    flat = torch.zeros(numel)
    best = float("inf")
    for _ in range(5):
        dist.barrier()
        began = time.perf_counter()
        dist.all_reduce(flat)
        best = min(best, time.perf_counter() - began)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="packed_kernel_rank")
    p.add_argument("--loader", choices=["odbd", "flatten"], required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--batch", type=int, default=4, help="flatten: samples per row")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--data-arg", action="append", default=[])
    p.add_argument(
        "--kernel",
        choices=["sdpa", "segments"],
        default="sdpa",
        help="attention: transformers' sdpa, or odbclient's per-sample segments",
    )
    p.add_argument(
        "--report",
        choices=["step", "forward-backward"],
        default="step",
        help="what report_compute times: the rank's whole own step (forward, "
        "backward, optimizer, the all-reduce's own cost) or forward/backward only",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    data = {k: int(v) if v.lstrip("-").isdigit() else float(v)
            for k, v in (a.split("=", 1) for a in args.data_arg)}  # fmt: skip
    data.update(as_torch=1, label_shift=0)  # HF labels: the model shifts
    dataset = LongTailTokens(**data)  # type: ignore[arg-type]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    model = build_llama(args.dim, args.layers, dataset.vocab, args.kernel)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    client = None
    if args.loader == "odbd":
        from odbclient import ODBClient, check_packed_model

        client = ODBClient(rank=rank, deadline_s=300.0)
        check_packed_model(model, ("input_ids", "labels", "position_ids", "cu_seq_lens_q"))
        rows = odbd_rows(client)
    else:
        rows = flatten_rows(dataset, args.batch, rank, world)
    # The all-reduce's own cost, without waits: measured once, after a barrier, best of 5.
    allreduce_s = 0.0
    if args.report == "step":
        allreduce_s = allreduce_cost(sum(q.numel() for q in params))
    steps = samples = tokens = 0
    compute = 0.0
    dist.barrier()
    start = time.perf_counter()
    for inputs, scale, batch in rows:
        began = time.perf_counter()
        if batch is None or not batch.is_idle:
            loss = model(**{k: v for k, v in inputs.items() if k != "loss_scale"}).loss
            (loss * scale).backward()
        spent = time.perf_counter() - began
        compute += spent
        flat = torch.cat(
            [(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in params]
        )
        dist.all_reduce(flat)
        offset = 0
        for q in params:
            n = q.numel()
            q.grad = flat[offset : offset + n].view_as(q) / world  # DDP's average
            offset += n
        stepped = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if client is not None:
            # The rank's own work in this step, no waits: forward/backward, the optimizer
            # step, and the all-reduce's own cost (measured once): the per-step constant
            # the planner weighs against more, shorter rows.
            own = spent
            if args.report == "step":
                own += time.perf_counter() - stepped + allreduce_s
            client.report_compute(own)
        steps += 1
        ids = inputs["input_ids"]
        tokens += int(ids.shape[-1]) if (batch is None or not batch.is_idle) else 0
        samples += (
            len(batch.sample_ids) if batch is not None else int(inputs["position_ids"].eq(0).sum())
        )
    dist.barrier()
    loop_s = time.perf_counter() - start
    counts = torch.tensor([samples, tokens], dtype=torch.float64)
    dist.all_reduce(counts)
    if rank == 0:
        result = {
            "loader": args.loader, "loop_s": loop_s, "steps": steps, "samples": int(counts[0]),
            "tokens": int(counts[1]), "compute_s": compute, "allreduce_s": allreduce_s,
        }  # fmt: skip
        (args.out_dir / "result.json").write_text(json.dumps(result))
    if client is not None:
        client.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
