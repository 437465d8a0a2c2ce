"""ODBClient epochs as plain dicts of tensors, the shape framework training loops consume."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from odbclient.batch import Batch
from odbclient.client import ODBClient

LOSS_SCALE_KEY = "odb_loss_scale"


class ODBBatches:
    """Iterable over one epoch of a rank's batches per `iter()`, like a DataLoader.

    Each item is the batch's tensors plus `LOSS_SCALE_KEY` -> a 0-d float64 tensor holding
    `Batch.loss_scale`; `last` is the Batch behind the item yielded last (sample ids, step,
    idle flag), for callbacks and logging. It has no `len()`: the number of steps of an epoch
    is decided online by the daemons, so loops must run until it is exhausted (and frameworks
    that plan by length need an upper bound such as Hugging Face's `max_steps`).
    """

    def __init__(self, client: ODBClient, *, loss_scale_key: str = LOSS_SCALE_KEY) -> None:
        self.client = client
        self.loss_scale_key = loss_scale_key
        self.last: Batch | None = None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.client:
            self.last = batch
            scale = torch.tensor(batch.loss_scale, dtype=torch.float64)
            yield {**batch.tensors, self.loss_scale_key: scale}
