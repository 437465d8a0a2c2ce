"""An Accelerate training loop fed by odbd (optional extra `odbd[hf]`).

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)   # not the data: odbd shards it
    odb = ODBAccelerate(accelerator, ODBClient(rank=accelerator.process_index))
    for epoch in range(epochs):
        for batch in odb:                                     # on accelerator.device
            loss = model(**batch.inputs).loss
            odb.backward(loss, batch)                         # loss * loss_scale
            optimizer.step(); optimizer.zero_grad()

odbd already decided which samples each rank trains in each step, so the batches must not go
through `accelerator.prepare` (which would shard them a second time).

With optimizer updates of several micro-steps (odbd `--accumulate K` or `--tokens-per-update
T`), accumulate locally and all-reduce once, at the update's last micro-step:

    for step in odb:
        with odb.sync(model, step):                           # no_sync() before update_end
            loss = model(**step.inputs).loss
            odb.backward(loss, step)                          # loss_scale: exact per update
        if step.batch.update_end:
            optimizer.step(); optimizer.zero_grad()

Do not also use Accelerate's own `gradient_accumulation_steps` (it divides the loss by its
count, on top of odbd's update-wide scale).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from odbclient.batch import Batch
from odbclient.client import ODBClient, launcher_world

__all__ = ["ODBAccelerate", "StepInputs"]


@dataclass(frozen=True, slots=True)
class StepInputs:
    inputs: dict[str, torch.Tensor | int]  # the batch's tensors on accelerator.device
    batch: Batch  # the odbd batch: loss_scale, sample_ids, is_idle, step, epoch...


class ODBAccelerate:
    """One rank's odbd epochs for an `Accelerator` loop, and the loss-scaled backward."""

    def __init__(self, accelerator: Accelerator, client: ODBClient) -> None:
        launched = launcher_world()
        if accelerator.num_processes == 1 and (launched.world_size or 1) > 1:
            # Found with the docs' `Accelerator()` under `accelerate launch --multi_gpu` (or a
            # MULTI_GPU config file) on a machine without GPUs: every process runs as Accelerate
            # rank 0 of 1, and the daemon's refusal then told the user to launch the processes
            # they had already launched.
            raise ValueError(
                "Accelerate runs this process alone (process 0 of 1), but the launcher started "
                f"it as rank {launched.rank} of {launched.world_size} ({launched.source}): the "
                "Accelerator did not join the launched processes, so every one of them would "
                "claim odbd rank 0. "
                "Nothing was trained. On a machine without GPUs build it with "
                "Accelerator(cpu=True) (`accelerate launch --multi_gpu` then starts gloo CPU "
                "ranks); else check the launch config's distributed_type and num_processes"
            )
        if client.rank != accelerator.process_index:
            raise ValueError(
                f"ODBClient rank {client.rank} is not this process's Accelerate rank "
                f"{accelerator.process_index}: build it with rank=accelerator.process_index"
            )
        self.accelerator = accelerator
        self.client = client
        # Accelerate knows its world even when `accelerate launch --cpu` started one process
        # for --num_processes 2: the daemon then refuses it instead of training rank 0 alone.
        client.set_world(accelerator.num_processes, accelerator.process_index, source="accelerate")

    def __iter__(self) -> Iterator[StepInputs]:
        device = self.accelerator.device
        for batch in self.client:
            yield StepInputs(inputs=batch.to(device), batch=batch)

    def sync(self, model: torch.nn.Module, step: StepInputs) -> contextlib.AbstractContextManager:
        """`accelerator.no_sync(model)` on an update's micro-steps before its last, so DDP
        all-reduces the accumulated gradient once; a no-op on the last (and without updates,
        where every step is one)."""
        if step.batch.update_end:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def backward(self, loss: torch.Tensor, step: StepInputs) -> None:
        """`accelerator.backward(loss * loss_scale)`; idle fillers backpropagate a zero."""
        self.accelerator.backward(loss * step.batch.loss_scale)
