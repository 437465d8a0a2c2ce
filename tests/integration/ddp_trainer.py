"""A real DDP trainer rank (CPU, gloo), launched like torchrun launches one.

    RANK=r WORLD_SIZE=W LOCAL_RANK=l MASTER_ADDR=127.0.0.1 MASTER_PORT=p ODBD_SOCKET=... \\
        python -m tests.integration.ddp_trainer --loader odbd --out-dir DIR [options]

Trains `ddp_model.TinyCausalLM` and writes DIR/rank{r}.jsonl: one line per step
(`Step.record()` plus the rank's unscaled mean loss), then {"done": true, ...} with the training
loop's wall time and, on rank 0, the held-out loss before and after training.

`--grads` is the gradient check: no optimizer step, so every step runs on the initial weights,
and rank 0 saves the gradient DDP produced for each step to DIR/grad-e{epoch}-s{step}.pt.
`--stop-at E:S` saves a checkpoint (model, optimizer, ODBClient.state_dict()) to
DIR/ckpt-rank{r}.pt after step S of epoch E and exits; `--resume` loads it and carries on.

`--timed` (the cost model's runs, issue 14): each step's forward and backward run under
`no_sync()` and are timed, the rank reports that time (`ODBClient.report_compute`) and records
it as "compute_s", and only then are the gradients all-reduced, so the time is the rank's own
work without the wait for the slowest rank. `--quadratic-dim D` adds explicit O(sum l^2) work,
a D-wide self-attention score matrix per sample (2 * l^2 * D flops), as long-context
attention kernels have: the run's true step cost then has a strong quadratic term.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.integration import ddp_loaders
from tests.integration.ddp_data import LongTailTokens
from tests.integration.ddp_model import (
    ModelConfig,
    build_model,
    evaluate,
    flat_grad,
    packed_mean_loss,
)
from tests.integration.ddp_model import mean_token_loss as mean_loss

HELD_OUT_SEED_OFFSET = 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ddp_trainer")
    p.add_argument("--loader", choices=["odbd", "fixed", "paper"], default="odbd")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="model init and sampler shuffling")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    for name, default in vars(ModelConfig()).items():
        p.add_argument(f"--model-{name.replace('_', '-')}", type=int, default=default)
    p.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--batch-size", type=int, default=4, help="fixed loader")
    p.add_argument("--token-budget", type=int, default=1024, help="paper loader")
    p.add_argument("--buffer", type=int, default=64, help="paper loader")
    p.add_argument("--workers", type=int, default=0, help="fixed loader worker processes")
    p.add_argument("--grads", action="store_true", help="save DDP gradients, no optimizer step")
    p.add_argument("--stop-at", default="", metavar="EPOCH:STEP", help="checkpoint and exit")
    p.add_argument(
        "--stop-after-update",
        default="",
        metavar="EPOCH:UPDATE",
        help="checkpoint and exit after the update's end (odbd --align updates: ranks run "
        "different steps, so a step number does not stop every rank)",
    )
    p.add_argument("--resume", action="store_true", help="continue from DIR/ckpt-rank{r}.pt")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="checkpoint after every N-th step and carry on (a job killed later resumes there)",
    )
    p.add_argument("--eval-size", type=int, default=0, help="held-out samples (rank 0)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timed", action="store_true", help="time and report each step's compute")
    p.add_argument("--quadratic-dim", type=int, default=0, help="O(l^2 * D) work per sample")
    p.add_argument("--packed", action="store_true", help="odbd --collate packed, HF labels")
    return p.parse_args(argv)


def data_kwargs(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


class Run:
    """One rank's model, optimizer, data path and report file."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        dtype = getattr(torch, args.dtype)
        config = ModelConfig(**{k: getattr(args, f"model_{k}") for k in vars(ModelConfig())})
        self.module = build_model(config, seed=args.seed, dtype=dtype)
        self.model = DistributedDataParallel(self.module)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.data = data_kwargs(args.data_arg)
        self.client: Any = None
        self.lengths: Any = None  # dataset lengths by id (--quadratic-dim)
        self.scratch = torch.zeros(0)
        self.start_epoch, self.steps_done = 0, 0
        self.report = open(args.out_dir / f"rank{self.rank}.jsonl", "a")  # noqa: SIM115

    def checkpoint_path(self) -> Path:
        return self.args.out_dir / f"ckpt-rank{self.rank}.pt"

    def epochs(self) -> Iterator[Iterator[ddp_loaders.Step]]:
        args = self.args
        if args.loader == "odbd":
            from odbclient import ODBClient

            self.client = ODBClient(rank=self.rank, deadline_s=120.0)
            if args.resume:
                self.load_checkpoint()
            for _ in range(self.start_epoch, args.epochs):
                yield ddp_loaders.odbd_epoch(self.client)
            return
        dataset = LongTailTokens(**self.data, as_torch=int(args.loader == "paper"))
        if args.loader == "fixed":
            loader = ddp_loaders.fixed_loader(
                dataset, batch_size=args.batch_size, world=self.world, rank=self.rank,
                seed=args.seed, workers=args.workers,
            )  # fmt: skip
            for epoch in range(args.epochs):
                yield ddp_loaders.fixed_epoch(loader, epoch)
            return
        paper = ddp_loaders.paper_loader(
            dataset, token_budget=args.token_budget, buffer=args.buffer, world=self.world,
            rank=self.rank, seed=args.seed,
        )  # fmt: skip
        for epoch in range(args.epochs):
            yield ddp_loaders.paper_epoch(paper, epoch, self.world)

    def timed_step(self, step: ddp_loaders.Step) -> None:
        """--timed: local forward/backward (+ quadratic work) timed, then the all-reduce."""
        self.optimizer.zero_grad(set_to_none=False)
        started = time.perf_counter()
        with self.model.no_sync():
            loss = mean_loss(self.model, step.tensors)
            (loss * step.loss_scale).backward()
        self.quadratic_work(step.ids)
        compute_s = time.perf_counter() - started
        self.client.report_compute(compute_s)
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # what DDP would do in backward: the mean over ranks
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self.optimizer.step()
        record = {**step.record(), "loss": float(loss.detach()), "compute_s": compute_s}
        self.report.write(json.dumps(record) + "\n")
        self.report.flush()
        self.steps_done += 1

    def quadratic_work(self, ids: list[int]) -> None:
        """2 * l^2 * D flops per sample of length l: a score matrix like attention's."""
        dim = self.args.quadratic_dim
        if not dim:
            return
        if self.lengths is None:
            self.lengths = LongTailTokens(**self.data).lengths
            self.scratch = torch.ones((int(self.lengths.max()), dim))
        for length in self.lengths[ids].tolist():
            block = self.scratch[:length]
            torch.mm(block, block.T)

    def train_step(self, step: ddp_loaders.Step) -> None:
        if self.args.timed:
            self.timed_step(step)
            return
        if step.update_start:
            self.optimizer.zero_grad(set_to_none=True)
        # odbd's optimizer updates: gradients accumulate locally over the update's micro-steps
        # (no_sync) and DDP all-reduces once, at its last; every rank has the same micro-steps.
        sync = contextlib.nullcontext() if step.update_end else self.model.no_sync()
        with sync:
            if self.args.packed:
                loss = packed_mean_loss(self.model, step.tensors)
            else:
                loss = mean_loss(self.model, step.tensors)
            # An idle filler still runs forward and backward (loss_scale 0) so DDP's all-reduce
            # sees every rank; DDP then averages, so the update's gradient is
            # (1/W) * sum over micro-steps and ranks of loss_scale * grad(mean).
            (loss * step.loss_scale).backward()
        if not step.update_end:
            pass
        elif self.args.grads:
            if self.rank == 0:
                name = f"s{step.step}" if step.update is None else f"u{step.update['index']}"
                path = self.args.out_dir / f"grad-e{step.epoch}-{name}.pt"
                torch.save(flat_grad(self.module).detach().clone(), path)
        else:
            self.optimizer.step()
        record = {**step.record(), "loss": float(loss.detach())}
        self.report.write(json.dumps(record) + "\n")
        self.report.flush()
        self.steps_done += 1

    def save_checkpoint(self) -> None:
        state = {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "client": self.client.state_dict() if self.client is not None else None,
        }
        # Atomic: a rank that dies mid-save (--checkpoint-every) keeps its previous checkpoint.
        partial = self.checkpoint_path().with_suffix(".tmp")
        torch.save(state, partial)
        os.replace(partial, self.checkpoint_path())

    def load_checkpoint(self) -> None:
        state = torch.load(self.checkpoint_path(), weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.client.load_state_dict(state["client"])
        self.start_epoch = state["client"]["epoch"]

    def held_out_loss(self) -> float | None:
        if self.rank != 0 or not self.args.eval_size:
            return None
        seed = int(self.data.get("seed", 0)) + HELD_OUT_SEED_OFFSET
        held_out = LongTailTokens(**{**self.data, "seed": seed, "size": self.args.eval_size})
        return evaluate(self.module, [held_out[i] for i in range(len(held_out))])


def train(run: Run) -> dict[str, Any]:
    """The training loop; returns the closing facts. Stops early at --stop-at."""
    eval_start = run.held_out_loss()
    dist.barrier()
    started = time.perf_counter()
    for epoch_steps in run.epochs():
        with run.model.join(enable=run.args.loader == "paper"):
            for step in epoch_steps:
                run.train_step(step)
                stop_update = (
                    step.update is not None
                    and step.update_end
                    and (f"{step.epoch}:{step.update['index']}" == run.args.stop_after_update)
                )
                if f"{step.epoch}:{step.step}" == run.args.stop_at or stop_update:
                    run.save_checkpoint()
                    return {"stopped": True, "steps": run.steps_done}
                every = run.args.checkpoint_every
                if every and run.steps_done % every == 0:
                    run.save_checkpoint()
                    point = {"checkpoint": [step.epoch, step.step], "rank": run.rank}
                    run.report.write(json.dumps(point) + "\n")
                    run.report.flush()
    dist.barrier()
    loop_s = time.perf_counter() - started
    return {"loop_s": loop_s, "eval_start": eval_start, "eval_end": run.held_out_loss()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from env
    run = Run(args)
    try:
        closing = train(run)
        run.report.write(json.dumps({"done": True, "rank": run.rank, **closing}) + "\n")
    finally:
        run.report.close()
        if run.client is not None:
            run.client.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
