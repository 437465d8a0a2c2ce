"""ODBClient epochs as plain dicts of tensors, the shape framework training loops consume."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from odbclient.batch import Batch
from odbclient.client import ODBClient
from odbclient.errors import ProtocolError

LOSS_SCALE_KEY = "odb_loss_scale"


class ODBBatches:
    """Iterable over one epoch of a rank's batches per `iter()`, like a DataLoader.

    Each item is the batch's tensors plus `LOSS_SCALE_KEY` -> a 0-d float64 tensor holding
    `Batch.loss_scale`; `last` is the Batch behind the item yielded last (sample ids, step,
    idle flag, `progress`), for callbacks, logging and LR schedules. It has no `len()`: the
    number of steps of an epoch is decided online by the daemons (`last.progress` estimates
    it), so loops must run until it is exhausted, or call `finish_epoch()` after the step that
    `progress` marks as the epoch's last. `on_epoch_end` runs whenever an epoch's iteration
    ends (a framework loop that planned more steps can stop waiting for them).
    """

    def __init__(
        self,
        client: ODBClient,
        *,
        loss_scale_key: str = LOSS_SCALE_KEY,
        on_epoch_end: Callable[[], None] = lambda: None,
    ) -> None:
        self.client = client
        self.loss_scale_key = loss_scale_key
        self.on_epoch_end = on_epoch_end
        self.last: Batch | None = None
        self._epoch: Iterator[Batch] | None = None  # the client's epoch iterator, while live

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._epoch = iter(self.client)
        for batch in self._epoch:
            self.last = batch
            scale = torch.tensor(batch.loss_scale, dtype=torch.float64)
            yield {**batch.tensors, self.loss_scale_key: scale}
        self._epoch = None
        self.on_epoch_end()

    def finish_epoch(self) -> bool:
        """After the epoch's last batch (`last.progress.epoch_steps_exact` and its step is the
        last): reads the epoch's end, and the job's end after its last epoch, without waiting
        for the loop to ask for another batch. True when the job is over."""
        last = self.last
        if self._epoch is not None:
            for extra in self._epoch:
                raise ProtocolError(
                    f"odbd sent epoch {extra.epoch} step {extra.step} after the step it marked "
                    f"as the epoch's last ({last.step if last else '?'}); daemon and odbclient "
                    "versions differ"
                )
            self._epoch = None
        if last is not None and last.progress.job_fraction >= 1.0 and not self.client.job_ended:
            for extra in self.client:  # the job's end follows its last epoch
                raise ProtocolError(
                    f"odbd sent epoch {extra.epoch} step {extra.step} after the job's last step"
                )
        return self.client.job_ended
