"""An `accelerate launch` rank of test_accelerate_resume.py: an Accelerate loop through
`ODBAccelerate` on a tiny Llama, `accelerator.save_state()` every few optimizer steps.

    accelerate launch --multi_gpu --num_processes 2 -m tests.integration.accelerate_resume_train \\
        --out-dir DIR [--hang-after-checkpoint N | --resume]

Checkpoints use `ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)`
(DIR/acc/checkpoints/checkpoint_N); the optimizer steps taken are a registered object of the
user's (`accelerator.register_for_checkpointing`), beside odbd's state. Each rank appends to
DIR/rank{r}.jsonl, per odbd micro-step {"micro": true, "update", "epoch", "step", "ids"}
(update: the optimizer step it belongs to, from 1), per checkpoint {"saved": N, "updates",
"weights"} and after load_state {"loaded": N, "updates", "weights", "epoch"} (weights: a sum of
the model's parameters), and {"done": true, "updates"} at the end.
`--hang-after-checkpoint N`: after the first checkpoint saved in odbd's epoch 1, the rank
trains N more optimizer steps (0: none), writes DIR/hung{r} and waits to be SIGKILLed.
`--resume`: `accelerator.load_state()` (the newest checkpoint) before the loop.
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


class Updates:
    """The optimizer steps taken: the user's own object in Accelerate's checkpoints."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def main() -> int:
    p = argparse.ArgumentParser(prog="accelerate_resume_train")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--hang-after-checkpoint", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--save-every", type=int, default=3, help="optimizer steps per checkpoint")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    # prefetch 2: every Delivered report is sent at once (report_every = prefetch // 2), so the
    # daemon's view of what was delivered does not depend on timing
    client = ODBClient(rank=rank, prefetch=2, deadline_s=120.0)
    report = open(args.out_dir / f"rank{rank}.jsonl", "a")  # noqa: SIM115
    try:
        updates = train(args, client, rank, report)
        report.write(json.dumps({"done": True, "updates": updates}) + "\n")
    finally:
        report.close()
        client.close()
    return 0


def train(args: argparse.Namespace, client: ODBClient, rank: int, report: Any) -> int:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from odbclient.adapters.accelerate import ODBAccelerate

    def record(**fields: Any) -> None:
        report.write(json.dumps(fields) + "\n")
        report.flush()

    project = ProjectConfiguration(project_dir=str(args.out_dir / "acc"),
                                   automatic_checkpoint_naming=True, total_limit=2)  # fmt: skip
    accelerator = Accelerator(cpu=True, project_config=project)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    odb = ODBAccelerate(accelerator, client)
    updates = Updates()
    accelerator.register_for_checkpointing(updates)
    if args.resume:
        accelerator.load_state()  # the newest checkpoint_N
        record(loaded=accelerator.save_iteration - 1, updates=updates.count,
               weights=weight_sum(model), epoch=client.epoch)  # fmt: skip
    saved_in_epoch_1: list[int] = []
    while not client.job_ended:  # docs/training.md's loop: it continues at the checkpoint
        for step in odb:
            batch = step.batch
            record(micro=True, update=updates.count + 1, epoch=batch.epoch, step=batch.step,
                   ids=list(batch.sample_ids))  # fmt: skip
            with odb.sync(model, step):
                loss = model(**step.inputs).loss
                odb.backward(loss, step)
            if not batch.update_end:
                continue
            optimizer.step()
            optimizer.zero_grad()
            updates.count += 1
            hang = args.hang_after_checkpoint
            if saved_in_epoch_1 and hang > 0 and updates.count == saved_in_epoch_1[0] + hang:
                hang_until_killed(args.out_dir, rank)
            if updates.count % args.save_every == 0:
                iteration = accelerator.save_iteration
                accelerator.save_state()
                record(saved=iteration, updates=updates.count, weights=weight_sum(model))
                if batch.epoch == 1 and not saved_in_epoch_1:
                    saved_in_epoch_1.append(updates.count)
                    if hang == 0:
                        hang_until_killed(args.out_dir, rank)
    accelerator.end_training()
    return updates.count


def weight_sum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def hang_until_killed(out_dir: Path, rank: int) -> None:
    (out_dir / f"hung{rank}").write_text("")
    while True:  # the crash: the test SIGKILLs this process
        time.sleep(1.0)


if __name__ == "__main__":
    end_rank(main())  # an exception propagates before it, with its traceback and status 1
