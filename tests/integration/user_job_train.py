"""The trainer of the user-job test: a script an ML engineer would write, run by real torchrun.

    torchrun --standalone --nproc-per-node 2 -m tests.integration.user_job_train \\
        --out-dir DIR --step-s 2

A GPT-2 with random weights (built from a config: nothing downloaded) trained by the Hugging
Face Trainer through odbd's adapter, with a cosine schedule and warm-up. Each optimizer step
is slowed to at least `--step-s` seconds (standing in for a real model's compute). Every rank
appends {"epoch", "step", "ids", "idle", "lr"} per step to DIR/rank{r}.jsonl and a closing
{"done": true, ...} line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from odbclient import ODBClient
from tests.integration.rank_exit import end_rank
from tests.integration.user_job_data import vocab_size


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size(), n_positions=256, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def train(args: argparse.Namespace, client: ODBClient, report: Any) -> dict[str, Any]:
    from transformers import TrainerCallback, TrainingArguments

    from odbclient.adapters.hf import ODBTrainer

    class SlowStepsAndRecord(TrainerCallback):
        def on_step_begin(self, _args: Any, _state: Any, _control: Any, **_: Any) -> None:
            self.began_s = time.monotonic()

        def on_pre_optimizer_step(self, _args: Any, _state: Any, _control: Any, **_: Any) -> None:
            batch = trainer.odb_batches.last
            assert batch is not None
            lr = trainer.lr_scheduler.get_last_lr()[0]
            record = {"epoch": batch.epoch, "step": batch.step, "ids": list(batch.sample_ids),
                      "idle": batch.is_idle, "lr": lr}  # fmt: skip
            report.write(json.dumps(record) + "\n")
            report.flush()

        def on_step_end(self, _args: Any, _state: Any, _control: Any, **_: Any) -> None:
            # A real model's step: at least --step-s of compute per optimizer step.
            time.sleep(max(0.0, args.step_s - (time.monotonic() - self.began_s)))

    training_args = TrainingArguments(
        output_dir=str(args.out_dir / "hf"),
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        num_train_epochs=args.epochs,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    trainer = ODBTrainer(model=gpt2(), args=training_args, odb_client=client,
                         callbacks=[SlowStepsAndRecord()])  # fmt: skip
    result = trainer.train()
    return {"global_step": result.global_step, "max_steps": trainer.state.max_steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="user_job_train")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--step-s", type=float, default=2.0)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    client = ODBClient(rank=rank)
    with open(args.out_dir / f"rank{rank}.jsonl", "a") as report:
        try:
            closing = train(args, client, report)
        finally:
            client.close()
        report.write(json.dumps({"done": True, **closing}) + "\n")
    return 0


if __name__ == "__main__":
    end_rank(main())  # destroy_process_group, as every DDP script should end (rank_exit.py)
