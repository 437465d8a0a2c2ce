"""A torchrun rank of test_hf_resume.py: `ODBTrainer` on a tiny Llama, checkpoints every few steps.

    torchrun --nproc-per-node 2 -m tests.integration.hf_resume_train --out-dir DIR \\
        [--hang-after-checkpoint N | --resume]

Each rank appends to DIR/rank{r}.jsonl, per odbd micro-step as the Trainer takes it from the
loader, {"micro": true, "update", "epoch", "step", "ids"} (update: the Trainer's optimizer step
it belongs to), per optimizer step {"global_step", "epoch", "step", "lr", "fraction",
"trainer_epoch"} (the LR the step is taken with, odbd's job fraction after it), and
{"done": true, "global_step", "max_steps"} at the end.
`--hang-after-checkpoint N` (< --save-steps): after the first checkpoint saved in odbd's
epoch 1, the rank trains N more steps (0: none, it hangs right after saving), writes
DIR/hung{r} and waits to be killed (the test SIGKILLs every process of the job: a crash
between two checkpoints).
`--resume`: `train(resume_from_checkpoint=True)`. `--max-steps N`: the Trainer's own cap (on an
endless `--epochs 0` job: every rank calls end_job() at it).
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
from tests.integration.ddp_hf_trainer import tiny_llama
from tests.integration.rank_exit import end_rank


def main() -> int:
    p = argparse.ArgumentParser(prog="hf_resume_train")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--hang-after-checkpoint", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--grad-accum", type=int, default=1, help="odbd's --accumulate")
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=-1, help="the Trainer's max_steps")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    # prefetch 2: every Delivered report is sent at once (report_every = prefetch // 2), so the
    # daemon's view of what was delivered does not depend on timing
    # ODBD_SOCKETS: one socket per rank (a daemon per node); else ODBD_SOCKET for every rank
    sockets = os.environ.get("ODBD_SOCKETS", "").split(",")
    socket = sockets[rank] if len(sockets) > rank and sockets[rank] else None
    client = ODBClient(rank=rank, socket=socket, prefetch=2, deadline_s=120.0)
    report = open(args.out_dir / f"rank{rank}.jsonl", "a")  # noqa: SIM115
    try:
        result = train(args, client, rank, report)
        report.write(json.dumps({"done": True, **result}) + "\n")
    finally:
        report.close()
        client.close()
    return 0


def train(args: argparse.Namespace, client: ODBClient, rank: int, report: Any) -> dict:
    from transformers import TrainerCallback, TrainingArguments

    from odbclient.adapters.hf import ODBTrainer

    saved_in_epoch_1: list[int] = []  # global steps of the checkpoints saved in odbd's epoch 1

    def record(**fields: Any) -> None:
        report.write(json.dumps(fields) + "\n")
        report.flush()

    class RecordedTrainer(ODBTrainer):
        """Records every micro-step as the Trainer takes it from the loader: with
        gradient_accumulation_steps it takes an update's batches before running them, so the
        callbacks only ever see the update's last one."""

        def get_train_dataloader(self) -> Any:
            return _Recorded(super().get_train_dataloader(), self, record)

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, _args, state, _control, **kwargs: Any) -> None:
            self.lr = kwargs["optimizer"].param_groups[0]["lr"]  # the LR of this step

        def on_step_end(self, _args, state, _control, **_: Any) -> None:
            batch = trainer.odb_batches.last
            assert batch is not None
            record(global_step=state.global_step, epoch=batch.epoch, step=batch.step,
                   lr=self.lr, fraction=batch.progress.job_fraction,
                   trainer_epoch=state.epoch)  # fmt: skip
            hang = args.hang_after_checkpoint
            if saved_in_epoch_1 and hang > 0 and state.global_step == saved_in_epoch_1[0] + hang:
                hang_until_killed(state.global_step)

        def on_save(self, _args, state, _control, **_: Any) -> None:
            batch = trainer.odb_batches.last
            if batch is not None and batch.epoch == 1:
                saved_in_epoch_1.append(state.global_step)
                if args.hang_after_checkpoint == 0:
                    hang_until_killed(state.global_step)

    def hang_until_killed(global_step: int) -> None:
        (args.out_dir / f"hung{rank}").write_text(str(global_step))
        while True:  # the crash: the test SIGKILLs this process
            time.sleep(1.0)

    training_args = TrainingArguments(
        output_dir=str(args.out_dir / "hf"),
        learning_rate=1e-3,
        lr_scheduler_type="linear",  # over odbd's job fraction: the LR shows where resume is
        per_device_train_batch_size=1,  # unused: odbd sizes the batches
        gradient_accumulation_steps=args.grad_accum,
        use_cpu=True,
        report_to=[],
        save_strategy="steps",
        save_steps=args.save_steps,
        max_steps=args.max_steps,
        save_total_limit=2,  # older checkpoints are rotated away
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    trainer = RecordedTrainer(model=tiny_llama(), args=training_args, odb_client=client,
                              callbacks=[Record()])  # fmt: skip
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    return {"global_step": result.global_step, "max_steps": trainer.state.max_steps}


class _Recorded:
    """Iterates an ODBBatches, recording each new odbd batch (zero-scaled fillers skipped)."""

    def __init__(self, batches: Any, trainer: Any, record: Any) -> None:
        self.batches, self.trainer, self.record = batches, trainer, record

    def __iter__(self) -> Any:
        seen = None
        for item in self.batches:
            if (batch := self.batches.last) is not seen:
                seen = batch
                self.record(micro=True, update=self.trainer.state.global_step + 1,
                            epoch=batch.epoch, step=batch.step,
                            ids=list(batch.sample_ids))  # fmt: skip
            yield item


if __name__ == "__main__":
    end_rank(main())  # an exception propagates before it, with its traceback and status 1
