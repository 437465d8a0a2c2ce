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

The same loop runs odbd `--align updates`, where each rank runs its own number of micro-steps
per update (`update_end` is then the rank's own last): DDP and DeepSpeed ZeRO-1/2 only. FSDP,
DeepSpeed ZeRO-3 and Megatron run collectives in every micro-step and are refused at the first
batch (`ProtocolError`).

`--cost-model auto`: with `odb.backward(loss, step)` the loop's steps are timed and each is
reported as the rank's own compute (`ODBClient.report_compute`, before the next batch is asked
for): the forward (from the batch's hand-over to `odb.backward`), the backward (2x the forward
where it ran the DDP all-reduce: waits for other ranks are never counted) and what the loop does
after it until it asks for the next batch (the optimizer step), `odbclient.adapters.step_time`.
Keep collectives of your own (e.g. `accelerator.gather` for logging) out of that stretch, or
log every N steps: their waits would count as this rank's work.

Do not also use Accelerate's own `gradient_accumulation_steps` (it divides the loss by its
count, on top of odbd's update-wide scale).

Checkpoints: `accelerator.save_state(dir)` also writes every rank's `odbd_client_rank{R}.json`
(its `ODBClient.state_dict()`, world, rank, the daemon's job id; `odbclient.adapters.
hf_checkpoint`), and `accelerator.load_state(dir)` loads this rank's before Accelerate loads
anything, so the client continues at the step after the checkpoint:

    odb = ODBAccelerate(accelerator, ODBClient(rank=accelerator.process_index))
    accelerator.load_state(checkpoint)                      # before the first `for step in odb`
    for epoch in range(odb.client.epoch, epochs):           # the checkpoint's epoch
        for step in odb: ...

With `ProjectConfiguration(automatic_checkpoint_naming=True)`, `load_state()` (the newest
checkpoint_N) also sets Accelerate's checkpoint count to N + 1, so the next `save_state()`
writes checkpoint_{N+1} (Accelerate itself restarts at 0).

ODBAccelerate registers Accelerate's save/load pre-hooks for this, not the client through
`register_for_checkpointing`: Accelerate saves registered objects on the main process only
(`custom_checkpoint_0.pkl`) and loads that one file into every rank, so every rank would
resume at rank 0's position, and a checkpoint saved without the object fails Accelerate's
count check without naming what is missing. The hooks run on every process. Exact on daemons
left running (they rewind: the same samples in the same steps) and on daemons restarted from
their `--state-dir`; a daemon restarted without it refuses the checkpoint (`RankRefusedError`
naming the checkpoint's file and the node).
Refused before anything is loaded, with the fix (`CheckpointStateError`): a directory without
this rank's file, of another world or job; `StateDictError`: `load_state` after the first
iteration (the resume point is sent when connecting), and `save_state` in the middle of an
odbd update (save after `optimizer.step()` on a batch with `update_end`). docs/training.md,
"Resuming an Accelerate loop".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from odbclient.adapters.hf_checkpoint import (
    ACCELERATE,
    ClientCheckpoint,
    client_state_path,
    load_client_state,
    write_client_state,
)
from odbclient.adapters.step_time import StepTime, own_clock
from odbclient.errors import JobMismatchError, RankRefusedError, StateDictError
from odbclient.trainer.batch import Batch
from odbclient.trainer.client import ODBClient, launcher_world
from odbclient.trainer.packed_check import check_packed_model, is_packed_batch
from odbclient.trainer.update_align import refuse_distributed_type, refuse_per_layer_collectives

__all__ = ["ODBAccelerate", "StepInputs"]


@dataclass(frozen=True, slots=True)
class StepInputs:
    inputs: dict[str, torch.Tensor | int]  # the batch's tensors on accelerator.device
    batch: Batch  # the odbd batch: loss_scale, sample_ids, is_idle, step, epoch...


class ODBAccelerate:
    """One rank's odbd epochs for an `Accelerator` loop, and the loss-scaled backward."""

    def __init__(
        self, accelerator: Accelerator, client: ODBClient, model: torch.nn.Module | None = None
    ) -> None:
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
        # With the model, the first packed batch is checked against it (packed_check.py): a
        # model that attends across a row's samples is refused before it trains.
        self.model = model
        self._packed_checked = model is None
        # Accelerate knows its world even when `accelerate launch --cpu` started one process
        # for --num_processes 2: the daemon then refuses it instead of training rank 0 alone.
        client.set_world(accelerator.num_processes, accelerator.process_index, source="accelerate")
        self.resumed_from: Path | None = None  # this rank's file that load_state() loaded
        self._align_checked = False  # --align updates: the distributed type was checked
        self._models_checked: list[torch.nn.Module] = []
        # report_compute: when the batch was handed over, odb.backward's start and end, and
        # whether that backward ran under no_sync (it then waited for no rank).
        self._handed_at = 0.0
        self._backward: tuple[float, float] | None = None
        self._no_sync_batch: Batch | None = None
        accelerator.register_save_state_pre_hook(self._save_client_state)
        accelerator.register_load_state_pre_hook(self._load_client_state)

    def __iter__(self) -> Iterator[StepInputs]:
        device = self.accelerator.device
        for batch in self._batches():
            if batch.update_per_rank and not self._align_checked:
                self._refuse_sharded_parameters()
            inputs = batch.to(device)
            if not self._packed_checked and is_packed_batch(inputs):
                check_packed_model(self.model, inputs.keys())
                self._packed_checked = True
            self._backward = None
            self._handed_at = self._clock()
            yield StepInputs(inputs=inputs, batch=batch)
            self._report_compute(batch)

    def _clock(self) -> float:
        return own_clock(self.accelerator.device)

    def _report_compute(self, batch: Batch) -> None:
        """The step the loop just finished, timed by odb.backward (no report without it)."""
        if self._backward is None or batch.is_idle or self.client.job_ended:
            return
        began, ended = self._backward
        alone = self.accelerator.num_processes == 1 or self._no_sync_batch is batch
        timed = StepTime(
            forward=began - self._handed_at,
            backward=ended - began if alone else None,
            optimizer=self._clock() - ended,
        )
        self.client.report_compute(timed.own_seconds)

    def _refuse_sharded_parameters(self) -> None:
        """odbd --align updates: ranks run different micro-step counts per update, which FSDP
        and DeepSpeed ZeRO-3 cannot (odbclient.trainer.update_align), refused at the first batch."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        stage = getattr(plugin, "zero_stage", None) if plugin is not None else None
        refuse_distributed_type(self.accelerator.distributed_type, stage)
        self._align_checked = True

    def _batches(self) -> Iterator[Batch]:
        """The client's epoch; a daemon refusing the loaded checkpoint's resume point (at the
        connect, so at the first batch) is named with the checkpoint's file."""
        if self.client.started or self.resumed_from is None:
            yield from self.client
            return
        try:
            batches = iter(self.client)
            first = next(batches, None)
        except (JobMismatchError, RankRefusedError) as error:
            raise type(error)(
                f"resuming from {self.resumed_from}: {error} (the daemon refused the "
                "checkpoint's resume point; nothing was trained after accelerator.load_state)"
            ) from error
        if first is not None:
            yield first
            yield from batches

    def _save_client_state(self, _models: Any, _weights: Any, output_dir: str) -> None:
        """Accelerate's save pre-hook, on every process: this rank's file, before Accelerate
        writes the model (a checkpoint with the model always has it)."""
        try:
            client_state = self.client.state_dict()
        except StateDictError as error:
            raise StateDictError(
                f"accelerator.save_state({output_dir}): {error}. Accelerate wrote nothing of "
                "this checkpoint, but may have created the directory: delete it if it is empty"
            ) from None
        state = ClientCheckpoint(
            rank=self.accelerator.process_index,
            world_size=self.accelerator.num_processes,
            job_id=self.client.daemon_job_id or "",
            global_step=self.accelerator.save_iteration,  # N of checkpoint_N when auto-named
            client=client_state,
        )
        write_client_state(output_dir, state)

    def _load_client_state(self, _models: Any, input_dir: str) -> None:
        """Accelerate's load pre-hook, on every process, before it loads anything: a refusal
        leaves the model, optimizer and client as they were."""
        rank = self.accelerator.process_index
        path = client_state_path(input_dir, rank)
        if self.client.started:
            raise StateDictError(
                f"accelerator.load_state({input_dir}) after ODBAccelerate started iterating: "
                "the resume point is sent when the client connects, so rank "
                f"{rank} cannot move to the checkpoint's. Nothing was loaded. Call "
                "accelerator.load_state() before the first `for step in odb` (restart the "
                "process to resume from it)"
            )
        state = load_client_state(
            self.client,
            input_dir,
            rank=rank,
            world_size=self.accelerator.num_processes,
            writer=ACCELERATE,
        )
        self.resumed_from = path
        project = self.accelerator.project_configuration
        if project.automatic_checkpoint_naming:
            # Accelerate restarts its count at 0: the next save_state would then raise on an
            # existing checkpoint_0, or, once total_limit rotated it away, write a checkpoint
            # older by number than the one resumed from, which the next load_state() skips.
            project.iteration = max(project.iteration, state.global_step + 1)

    def sync(self, model: torch.nn.Module, step: StepInputs) -> contextlib.AbstractContextManager:
        """`accelerator.no_sync(model)` on an update's micro-steps before its last, so DDP
        all-reduces the accumulated gradient once; a no-op on the last (and without updates,
        where every step is one)."""
        if step.batch.update_per_rank and model not in self._models_checked:
            refuse_per_layer_collectives(model)  # FSDP wrapped by hand, not by Accelerate
            self._models_checked.append(model)
        if step.batch.update_end:
            return contextlib.nullcontext()
        self._no_sync_batch = step.batch
        return self.accelerator.no_sync(model)

    def backward(self, loss: torch.Tensor, step: StepInputs) -> None:
        """`accelerator.backward(loss * loss_scale)`; idle fillers backpropagate a zero. Timed
        for --cost-model auto (see the module docstring)."""
        began = self._clock()
        self.accelerator.backward(loss * step.batch.loss_scale)
        self._backward = (began, self._clock())
