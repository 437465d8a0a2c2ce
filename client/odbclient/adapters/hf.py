"""Hugging Face `Trainer` fed by odbd (optional extra `odbd[hf]`).

    client = ODBClient(rank=int(os.environ["RANK"]))
    trainer = ODBTrainer(model=model, args=TrainingArguments(max_steps=10_000, ...),
                         odb_client=client)
    trainer.train()

`ODBTrainer` is a `Trainer` subclass that changes two things and patches nothing:
- `get_train_dataloader()` returns the rank's odbd batches (`ODBBatches`), not a sharded
  DataLoader: the daemons already decided which samples every rank trains in every step.
- `compute_loss()` multiplies the model's loss (the rank's per-token mean, as HF causal LMs
  compute it without `num_items_in_batch`) by the batch's `loss_scale`, so DDP's average is the
  per-token mean over the whole step with `--loss-scaling exact`. An idle filler (loss_scale 0)
  still runs forward and backward, keeping DDP's collectives matched.

Training ends when odbd ends the job (its last epoch): the next epoch yields no batch and the
Trainer stops; `max_steps` is only an upper bound, required because odbd epochs have no length
known in advance.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from odbclient.adapters.batches import LOSS_SCALE_KEY, ODBBatches
from odbclient.client import ODBClient

__all__ = ["LOSS_SCALE_KEY", "ODBBatches", "ODBTrainer"]


class ODBTrainer(Trainer):
    """A `transformers.Trainer` whose training batches and loss weights come from odbd."""

    def __init__(self, *args: Any, odb_client: ODBClient, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.max_steps <= 0:
            raise ValueError(
                "ODBTrainer needs TrainingArguments(max_steps=N > 0): odbd decides an epoch's "
                "steps online, so the Trainer cannot count them in advance; training still "
                "stops when odbd ends the job, so N is only an upper bound"
            )
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError(
                "ODBTrainer needs gradient_accumulation_steps=1: each odbd step's loss_scale "
                "weighs that step's tokens only, so accumulated micro-steps would be averaged "
                "per step rather than per token; raise odbd's --token-budget for bigger steps"
            )
        self.odb_batches = ODBBatches(odb_client)

    def get_train_dataloader(self) -> ODBBatches:  # type: ignore[override]
        return self.odb_batches

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        # num_items_in_batch is the Trainer's own cross-rank token count; odbd's loss_scale
        # already carries the exact one, so the model returns its plain per-rank mean.
        inputs = dict(inputs)
        scale = inputs.pop(LOSS_SCALE_KEY)
        outputs = model(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        loss = loss * scale.to(device=loss.device, dtype=loss.dtype)
        return (loss, outputs) if return_outputs else loss
