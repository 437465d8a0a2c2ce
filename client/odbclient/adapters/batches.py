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

    `micro_steps_per_update` K > 1 is for loops that step the optimizer every K batches (the
    HF Trainer's gradient_accumulation_steps): every odbd update must then have K micro-steps
    (odbd --accumulate K), and the epoch's last, short update is followed by K - n fillers (the
    update's last batch again with loss scale 0, an exact zero gradient on every rank alike), so
    the loop's K-batch chunks stay aligned with odbd's updates.
    """

    def __init__(
        self,
        client: ODBClient,
        *,
        loss_scale_key: str = LOSS_SCALE_KEY,
        on_epoch_end: Callable[[], None] = lambda: None,
        micro_steps_per_update: int = 1,
    ) -> None:
        self.client = client
        self.micro_steps_per_update = micro_steps_per_update
        self.loss_scale_key = loss_scale_key
        self.on_epoch_end = on_epoch_end
        self.last: Batch | None = None
        # Over every rank, of the steps handed out (fillers added here excluded): true
        # throughput for logs, whatever a framework's own count assumes.
        self.steps_taken = 0
        self.samples_taken = 0
        self.tokens_taken = 0
        self._epoch: Iterator[Batch] | None = None  # the client's epoch iterator, while live

    def __iter__(self) -> Iterator[dict[str, torch.Tensor | int]]:
        self._epoch = iter(self.client)
        k = self.micro_steps_per_update
        for batch in self._epoch:
            self._check_update(batch)
            self.last = batch
            self.steps_taken += 1
            self.samples_taken += batch.global_num_samples
            self.tokens_taken += batch.global_num_tokens
            scale = torch.tensor(batch.loss_scale, dtype=torch.float64)
            yield {**batch.tensors, self.loss_scale_key: scale}
            if batch.update_end and batch.update_num_steps < k:
                zero = torch.tensor(0.0, dtype=torch.float64)
                for _ in range(k - batch.update_num_steps):
                    yield {**batch.tensors, self.loss_scale_key: zero}
        self._epoch = None
        self.on_epoch_end()

    def _check_update(self, batch: Batch) -> None:
        k = self.micro_steps_per_update
        n = batch.update_num_steps
        if batch.update_per_rank:
            raise ProtocolError(
                f"odbd runs --align updates: update {batch.update_index} of epoch {batch.epoch} "
                f"has {n} micro-steps on this rank and other counts on others, but this "
                f"training loop steps the optimizer every {k} batch(es) on every rank. Nothing "
                "was trained; restart the daemons with --align steps, or train with a loop "
                "that steps at batch.update_end (ODBAccelerate, or your own; docs/training.md)"
            )
        if n == k or (n < k and batch.update_short):
            return
        flag = f"--accumulate {k}" if k > 1 else "no --accumulate / --tokens-per-update"
        raise ProtocolError(
            f"odbd's update {batch.update_index} of epoch {batch.epoch} has {n} micro-steps, but "
            f"this training loop steps the optimizer every {k} batches, so its updates would "
            f"straddle odbd's and their loss scales would be wrong; start odbd with {flag} "
            "(gradient_accumulation_steps must equal odbd's --accumulate)"
        )

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
