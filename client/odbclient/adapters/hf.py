"""Hugging Face `Trainer` fed by odbd (optional extra `odbd[hf]`).

    client = ODBClient(rank=int(os.environ["RANK"]))
    args = TrainingArguments(output_dir="out", lr_scheduler_type="cosine", warmup_steps=100)
    trainer = ODBTrainer(model=model, args=args, odb_client=client)
    trainer.train()

`ODBTrainer` is a `Trainer` subclass that changes six things and patches nothing:
- `get_train_dataloader()` returns the rank's odbd batches (`ODBBatches`), not a sharded
  DataLoader: the daemons already decided which samples every rank trains in every step.
- `compute_loss()` multiplies the model's loss (the rank's per-token mean, as HF causal LMs
  compute it without `num_items_in_batch`) by the batch's `loss_scale`, so DDP's average is the
  per-token mean over the whole step with `--loss-scaling exact`. An idle filler (loss_scale 0)
  still runs forward and backward, keeping DDP's collectives matched.
- `create_scheduler()` builds a LambdaLR over odbd's job fraction (`odbclient.adapters.
  schedule`): `lr_scheduler_type` constant, constant_with_warmup, linear, cosine or
  cosine_with_min_lr (`lr_scheduler_kwargs={"min_lr_rate": r}`), with `warmup_steps` (steps) or
  `warmup_ratio` (of the job); the decay reaches its floor on the job's last step.
- A callback keeps `state.max_steps` (the progress bar's total) at odbd's estimate of the job's
  steps, ends each epoch on its last step, and ends training on the job's last step, so no
  empty epoch is ever started.
- `--cost-model auto`: after every optimizer step the rank reports its own compute of the
  step's last batch (`ODBClient.report_compute`): forward, backward (2x the forward where it
  ran the DDP all-reduce: waits for other ranks are never counted) and the optimizer step
  (over `gradient_accumulation_steps`), `odbclient.adapters.step_time`.
- Checkpoints: every rank writes `odbd_client_rank{R}.json` (its `ODBClient.state_dict()`, world,
  rank, job id; `odbclient.adapters.hf_checkpoint`) into each `checkpoint-N` before the Trainer
  writes `trainer_state.json`. `train(resume_from_checkpoint=True or PATH)` loads it before the
  Trainer loads anything and keeps the Trainer from skipping batches (`_init_training_state`):
  odbd continues the rank at the step after the checkpoint. Exact on daemons left running
  (they rewind: the same samples in the same steps) and on daemons restarted from their
  `--state-dir`; a daemon restarted without it refuses the checkpoint (`RankRefusedError`,
  naming the node and the fix). A checkpoint without the file, of
  another world or job is refused by name before anything is trained (docs/training.md,
  "Resuming a Hugging Face Trainer").

`gradient_accumulation_steps=K` needs the daemons started with `--accumulate K`: each odbd
update is then K micro-steps whose loss scales are exact over the whole update, so the Trainer's
own division by K is turned off (`loss_is_scaled_for_ga`); the epoch's last update, which may be
shorter, is padded with zero-scaled fillers (`ODBBatches`). `--tokens-per-update` sizes updates
in micro-steps that vary, which the Trainer's fixed K-batch chunks cannot follow: use it with
the plain torch or Accelerate loop (docs/training.md). Logs carry `tokens_per_update`, the loss
tokens of the last update over every rank.

Ending: training ends with odbd's job (its --epochs or --max-updates), or earlier at the
Trainer's own cap, as the Trainer reads them: `max_steps` (> 0) optimizer steps, else
`num_train_epochs` epochs (fractions too). At that cap every rank calls `ODBClient.end_job()`
after the same step, so the daemons end the job there and exit 0, e.g. `max_steps` on an endless
(`--epochs 0`) job. The LR schedule follows whichever of the cap and odbd's job ends first.
Logs carry odbd's true epoch (epoch index + the fraction of it trained) and the final
`train_samples_per_second`, `train_steps_per_second` and `train_tokens_per_second` count the
samples and loss tokens trained over every rank, and the optimizer steps, in this `train()`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from odbclient.adapters.batches import LOSS_SCALE_KEY, ODBBatches
from odbclient.adapters.hf_checkpoint import (
    ClientCheckpoint,
    client_state_path,
    load_client_state,
    write_client_state,
)
from odbclient.adapters.schedule import Schedule, lr_factor
from odbclient.adapters.step_time import StepTime, own_clock
from odbclient.errors import JobMismatchError, RankRefusedError
from odbclient.trainer.client import ODBClient
from odbclient.trainer.packed_check import check_packed_model, is_packed_batch

__all__ = ["LOSS_SCALE_KEY", "ODBBatches", "ODBTrainer"]

# The Trainer needs max_steps > 0 for a dataloader without len(); without a user cap this
# stands in until the first batch's estimate replaces it. Never reached: epochs end on odbd's
# last step (ODBProgress), not after max_steps batches.
_NO_CAP = 1 << 40


class ODBTrainer(Trainer):
    """A `transformers.Trainer` whose batches, loss weights and LR schedule come from odbd."""

    # odbd's loss_scale is already exact over the whole update (and 1 micro-step without
    # accumulation): the Trainer must not divide the loss by gradient_accumulation_steps again.
    loss_is_scaled_for_ga = True

    def __init__(self, *args: Any, odb_client: ODBClient, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.odb_accumulate = int(self.args.gradient_accumulation_steps)
        self.odb_schedule = Schedule(
            kind=str(getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)),
            warmup_steps=int(self.args.warmup_steps) if self.args.warmup_steps >= 1 else 0,
            warmup_fraction=_warmup_fraction(self.args),
            min_lr_rate=_min_lr_rate(self.args),
        )
        self.odb_max_steps = self.args.max_steps if self.args.max_steps > 0 else None
        # As the Trainer reads them: max_steps wins over num_train_epochs.
        epochs = float(self.args.num_train_epochs)
        self.odb_max_epochs = epochs if self.odb_max_steps is None and epochs > 0 else None
        self._odb_taken_at_train: tuple[int, int] = (0, 0)  # (samples, tokens) at train()
        self.odb_resume_epoch = 0  # odbd's epoch at the checkpoint train() resumes from
        self._odb_packed_checked = False  # packed_check ran on this model (first packed batch)
        # report_compute: the forward compute_loss timed, the last training_step's parts, and
        # when the optimizer step began (ODBProgress).
        self._odb_forward_s: float | None = None
        self.odb_step_time: StepTime | None = None
        self.odb_optimizer_began = 0.0
        if self.odb_max_steps is None:
            self.args.max_steps = _NO_CAP
        # Loss scales assume the daemon's --world: the Trainer's own world is checked.
        odb_client.set_world(
            self.args.world_size, self.args.process_index, source="transformers TrainingArguments"
        )
        self.odb_batches = ODBBatches(
            odb_client,
            on_epoch_end=self._odb_epoch_ended,
            micro_steps_per_update=self.odb_accumulate,
        )
        # First, so the progress bar's total is updated before ProgressCallback draws the step.
        self.callback_handler.callbacks.insert(0, ODBProgress(self))

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        batches = self.odb_batches
        self._odb_taken_at_train = (batches.samples_taken, batches.tokens_taken)
        checkpoint = self._odb_checkpoint(resume_from_checkpoint)
        if checkpoint is None:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        path = self._odb_load_client_state(checkpoint)
        # The Trainer must not skip global_step batches of the stream: odbd already continues
        # at the checkpoint's next step. ignore_data_skip is the public switch for that (and
        # still restores the RNG); _init_training_state below also sets the epoch.
        skip, self.args.ignore_data_skip = self.args.ignore_data_skip, True
        try:
            return super().train(checkpoint, trial, ignore_keys_for_eval)
        except (JobMismatchError, RankRefusedError) as error:
            raise type(error)(
                f"resuming from {path}: {error} (the daemon refused the checkpoint's resume "
                "point; nothing was trained after the checkpoint was loaded)"
            ) from error
        finally:
            self.args.ignore_data_skip = skip

    def _odb_checkpoint(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint directory to resume from: True means the newest in output_dir."""
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        if resume_from_checkpoint is True:
            last = get_last_checkpoint(self.args.output_dir)
            if last is None:
                raise ValueError(
                    f"resume_from_checkpoint=True but output_dir {self.args.output_dir} holds no "
                    "checkpoint-N directory; nothing was trained. Pass the checkpoint's path, "
                    "or train without resume_from_checkpoint to start afresh"
                )
            return str(last)
        return str(resume_from_checkpoint)

    def _odb_load_client_state(self, checkpoint: str) -> Path:
        """Loads this rank's odbd position from the checkpoint, before the Trainer loads
        anything: the client then continues at the step after the checkpoint, so the Trainer
        must not skip batches (`_init_training_state`)."""
        rank = self.args.process_index
        state = load_client_state(
            self.odb_batches.client, checkpoint, rank=rank, world_size=self.args.world_size
        )
        self.odb_resume_epoch = int(state.client["epoch"])
        return client_state_path(checkpoint, rank)

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        # The Trainer would skip global_step batches of the stream (accelerate's
        # skip_first_batches, which also raised AttributeError on ODBBatches): odbd already
        # continues at the checkpoint's next step. Its epoch is odbd's, as in the first run
        # (ODBProgress ends every epoch on odbd's last step); the Trainer's would be
        # global_step // max_steps, i.e. 0.
        epochs, _ = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if resume_from_checkpoint is None:
            return epochs, 0
        return self.odb_resume_epoch, 0

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # Every rank writes its own state before the Trainer writes trainer_state.json (only
        # the main process does) and rotates old checkpoints: a checkpoint that the Trainer's
        # resume finds always holds every rank's file. state_dict() is where the client is
        # after this optimizer step (a Trainer checkpoint is at an update's end).
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        client = self.odb_batches.client
        state = ClientCheckpoint(
            rank=self.args.process_index,
            world_size=self.args.world_size,
            job_id=client.daemon_job_id or "",
            global_step=self.state.global_step,
            client=client.state_dict(),
        )
        write_client_state(Path(self._get_output_dir(trial)) / folder, state)
        super()._save_checkpoint(model, trial)

    def odb_clock(self) -> float:
        return own_clock(self.args.device)

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        self._odb_forward_s = None
        began = self.odb_clock()
        loss = super().training_step(model, inputs, num_items_in_batch)
        spent = self.odb_clock() - began
        forward = self._odb_forward_s
        if forward is not None:  # an odbd batch: compute_loss timed its forward
            # The backward all-reduced nothing (and so waited for no rank): one process, or
            # a micro-step before the update's last (the Trainer runs those under no_sync).
            alone = self.args.world_size == 1 or not self.accelerator.sync_gradients
            self.odb_step_time = StepTime(
                forward=forward, backward=spent - forward if alone else None
            )
        return loss

    def get_train_dataloader(self) -> ODBBatches:  # type: ignore[override]
        return self.odb_batches

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        if self.lr_scheduler is None:
            optimizer = optimizer if optimizer is not None else self.optimizer
            assert optimizer is not None, "create_optimizer() runs before create_scheduler()"
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer,
                lambda step: lr_factor(self.odb_schedule, self.odb_fraction(step), step),
            )
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def odb_fraction(self, steps_done: int | None = None) -> float:
        """How much of the run is trained: odbd's job fraction, or of the Trainer's own cap
        (max_steps, else num_train_epochs) when that ends the run first."""
        last = self.odb_batches.last
        fraction = last.progress.job_fraction if last is not None else 0.0
        if self.odb_max_steps is not None:
            # The scheduler's own count of optimizer steps done: it reads the fraction after
            # step k before the Trainer counts that step in global_step.
            done = self.state.global_step if steps_done is None else steps_done
            fraction = max(fraction, min(done / self.odb_max_steps, 1.0))
        elif self.odb_max_epochs is not None:
            fraction = max(fraction, min(self.odb_epoch() / self.odb_max_epochs, 1.0))
        return fraction

    def odb_epoch(self) -> float:
        """odbd's epoch as a float: the epoch's index plus the share of its steps trained
        (exactly the next integer after an epoch's last step). The Trainer's own would divide
        by the max_steps stand-in of an unknown epoch length (9.1e-13)."""
        last = self.odb_batches.last
        if last is None:
            return 0.0
        progress = last.progress
        if progress.epoch_steps_exact and last.step + 1 >= progress.epoch_steps_estimate:
            return float(last.epoch + 1)
        share = (last.step + 1) / max(progress.epoch_steps_estimate, last.step + 2)
        return last.epoch + share

    def odb_cap_reached(self) -> bool:
        """The Trainer's own cap (max_steps, else num_train_epochs) is reached after this
        optimizer step: the same on every rank, which trained the same steps."""
        if self.odb_max_steps is not None:
            return self.state.global_step >= self.odb_max_steps
        return self.odb_max_epochs is not None and self.odb_epoch() >= self.odb_max_epochs

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        if LOSS_SCALE_KEY not in inputs:
            # Not an odbd batch: the Trainer's own loader of `eval_dataset` (evaluate(), or
            # eval_strategy between training steps), whose loss is the Trainer's as it is.
            # Popping the key raised KeyError and killed the job at its first evaluation.
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not self._odb_packed_checked and is_packed_batch(inputs):
            # Once, before the first packed batch trains: a model that attends across the
            # samples of a row (a KV cache, an attention_mask, a kernel without packing
            # support) is refused naming the fix (odbclient/trainer/packed_check.py).
            check_packed_model(model, [k for k in inputs if k != LOSS_SCALE_KEY])
            self._odb_packed_checked = True
        # num_items_in_batch is the Trainer's own cross-rank token count; odbd's loss_scale
        # already carries the exact one, so the model returns its plain per-rank mean.
        inputs = dict(inputs)
        scale = inputs.pop(LOSS_SCALE_KEY)
        began = self.odb_clock()
        outputs = model(**inputs)
        self._odb_forward_s = self.odb_clock() - began
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        loss = loss * scale.to(device=loss.device, dtype=loss.dtype)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        last = self.odb_batches.last
        if last is not None and "loss" in logs:
            logs = {**logs, "tokens_per_update": float(last.update_tokens)}
        if last is not None:
            self.state.epoch = self.odb_epoch()  # Trainer.log writes it into logs["epoch"]
        runtime = logs.get("train_runtime")
        if runtime:  # train()'s final metrics: counted from what was trained, not max_steps
            samples, tokens = self._odb_taken_at_train
            batches = self.odb_batches
            logs = {
                **logs,
                "train_samples_per_second": round((batches.samples_taken - samples) / runtime, 3),
                "train_steps_per_second": round(self._odb_steps_this_train() / runtime, 3),
                "train_tokens_per_second": round((batches.tokens_taken - tokens) / runtime, 3),
            }
        super().log(logs, *args, **kwargs)

    def _odb_steps_this_train(self) -> int:
        return self.state.global_step - int(getattr(self, "_initial_global_step", 0))

    def _odb_epoch_ended(self) -> None:
        # The epoch ran out without a step marked last (e.g. a flush round with no step): the
        # loop must not wait for the rest of the max_steps it planned for this epoch.
        self.control.should_epoch_stop = True
        if self.odb_batches.client.job_ended:
            self.control.should_training_stop = True


class ODBProgress(TrainerCallback):
    """Follows odbd's progress after every optimizer step (see ODBTrainer)."""

    def __init__(self, trainer: ODBTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        self.trainer.odb_optimizer_began = self.trainer.odb_clock()

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        timed = self.trainer.odb_step_time
        if timed is not None:
            # Every micro-step of the update shares the optimizer step.
            spent = self.trainer.odb_clock() - self.trainer.odb_optimizer_began
            self.trainer.odb_step_time = StepTime(
                timed.forward, timed.backward, spent / self.trainer.odb_accumulate
            )

    def _report_compute(self) -> None:
        """The update's last batch (the one the client handed out last: the Trainer fetches an
        update's batches before training them, so only the last can be reported) with its
        own compute (odbclient.adapters.step_time), for --cost-model auto."""
        timed, self.trainer.odb_step_time = self.trainer.odb_step_time, None
        client = self.trainer.odb_batches.client
        if timed is not None and self.trainer.odb_batches.last is not None and not client.job_ended:
            client.report_compute(timed.own_seconds)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._report_compute()
        batches = self.trainer.odb_batches
        batch = batches.last
        if batch is None:
            return
        progress = batch.progress
        # odbd counts micro-steps; the Trainer counts optimizer steps (updates of K).
        k = self.trainer.odb_accumulate
        estimate = -(-progress.job_steps_estimate // k) or _NO_CAP  # 0: endless job, no total
        if self.trainer.odb_max_steps is not None:
            estimate = min(estimate, self.trainer.odb_max_steps)
        epoch_ends = progress.epoch_steps_exact and batch.step + 1 == progress.epoch_steps_estimate
        job_last = progress.job_fraction >= 1.0  # e.g. --max-updates: mid-epoch
        job_ends = (epoch_ends or job_last) and batches.finish_epoch()
        if not job_ends and self.trainer.odb_cap_reached():
            # The Trainer's own cap: every rank ends the job here, so the daemons exit 0
            # rather than wait for steps nobody will take (it raised max_steps instead).
            batches.client.end_job()
            job_ends = True
        # Never below the steps trained + 1 before the job's end: the Trainer stops at max_steps.
        state.max_steps = state.global_step if job_ends else max(estimate, state.global_step + 1)
        _set_progress_bar_total(self.trainer, state.max_steps)
        if epoch_ends:
            control.should_epoch_stop = True
        if job_ends:
            control.should_training_stop = True


def _set_progress_bar_total(trainer: Trainer, total: int) -> None:
    for callback in trainer.callback_handler.callbacks:
        bar = (
            getattr(callback, "training_bar", None)
            if isinstance(callback, ProgressCallback)
            else None
        )
        if bar is not None and bar.total != total:
            bar.total = total
            bar.refresh()


def _warmup_fraction(args: TrainingArguments) -> float:
    """warmup_ratio, or a fractional warmup_steps (transformers 5 reads < 1 as a ratio)."""
    ratio = float(getattr(args, "warmup_ratio", 0.0) or 0.0)
    steps = float(args.warmup_steps or 0)
    return ratio if ratio > 0 else (steps if 0 < steps < 1 else 0.0)


def _min_lr_rate(args: TrainingArguments) -> float:
    kwargs = args.lr_scheduler_kwargs
    return float(kwargs.get("min_lr_rate", 0.0)) if isinstance(kwargs, dict) else 0.0
