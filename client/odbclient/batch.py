"""The batch a trainer rank receives for one step (DESIGN.md section 2.2)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class Batch:
    """One rank's batch of one step; its tensors are fresh memory owned by the trainer.

    Every rank receives the same number of batches per epoch. An idle filler (`is_idle`) keeps
    DDP collectives matched on a rank with nothing to train: run forward and backward as
    usual; its `loss_scale` is 0, so it contributes nothing to the gradient.
    """

    tensors: dict[str, torch.Tensor] = field(repr=False)  # key -> (B, ...) padded per --pad
    epoch: int
    step: int  # index within the epoch, identical on every rank
    num_samples: int  # samples in this batch (0 for an idle filler)
    num_tokens: int  # loss-bearing tokens in this batch
    global_num_samples: int  # over every rank of this step
    global_num_tokens: int
    sample_ids: tuple[int, ...]  # dataset identities, in batch order
    is_idle: bool
    loss_scale: float  # multiply the rank's mean loss by this (--loss-scaling)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def to(
        self, device: torch.device | str, *, non_blocking: bool = False
    ) -> dict[str, torch.Tensor]:
        """The tensors moved to `device` (e.g. `model(**batch.to("cuda"))`)."""
        return {k: t.to(device, non_blocking=non_blocking) for k, t in self.tensors.items()}
