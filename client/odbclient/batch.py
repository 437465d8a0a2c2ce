"""The batch a trainer rank receives for one step (DESIGN.md section 2.2)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class Progress:
    """Where the epoch and the job stand once this step is trained; the same on every rank.

    odbd decides an epoch's steps online, so its length is an estimate that tightens as rounds
    are planned, exact (`epoch_steps_exact`) from the round holding the epoch's last step on.
    The fractions never decrease and are exactly 1.0 on the last step of the epoch (job), so an
    LR schedule driven by `job_fraction` reaches its floor on the last step whatever the
    estimate said earlier.
    """

    epoch_steps_estimate: int = 0  # steps this epoch will have (at least this step + 1)
    epoch_steps_exact: bool = False  # epoch_steps_estimate is final
    epoch_sample_fraction: float = 0.0  # of the epoch's dataset samples, emitted or rejected
    epoch_token_fraction: float = 0.0  # of its loss tokens (remaining at the mean length so far)
    epoch_tokens: int = 0  # loss-bearing tokens of the epoch's steps so far, every rank
    job_fraction: float = 0.0  # of the whole job (odbd --epochs); 0.0 when --epochs is 0
    job_steps_estimate: int = 0  # steps of the whole job; 0 when --epochs is 0 (endless)


@dataclass(frozen=True, kw_only=True, slots=True)
class Batch:
    """One rank's batch of one step; its tensors are fresh memory owned by the trainer.

    Every rank receives the same number of batches per epoch. An idle filler (`is_idle`) keeps
    DDP collectives matched on a rank with nothing to train: run forward and backward as
    usual; its `loss_scale` is 0, so it contributes nothing to the gradient.
    """

    # key -> (B, ...) padded per --pad; odbd --collate packed: (1, T) rows with position_ids,
    # cu_seq_lens_q/k tensors and max_length_q/k ints (Hugging Face padding-free conventions)
    tensors: dict[str, torch.Tensor | int] = field(repr=False)
    epoch: int
    step: int  # index within the epoch, identical on every rank
    num_samples: int  # samples in this batch (0 for an idle filler)
    num_tokens: int  # loss-bearing tokens in this batch
    global_num_samples: int  # over every rank of this step
    global_num_tokens: int
    sample_ids: tuple[int, ...]  # dataset identities, in batch order
    is_idle: bool
    loss_scale: float  # multiply the rank's mean loss by this (--loss-scaling)
    progress: Progress = field(default_factory=Progress)  # for LR schedules and progress bars
    # The optimizer update this micro-step belongs to (odbd --accumulate / --tokens-per-update;
    # without them every step is its own update). Step the optimizer after a batch with
    # update_end, and run the micro-steps before it under DDP's no_sync(): loss_scale is exact
    # over the whole update, so sum(loss_scale * mean loss) over its micro-steps, averaged by
    # DDP, is the per-token mean over every loss-bearing token of the update on every rank.
    update_end: bool = True
    update_index: int = 0  # within the epoch, identical on every rank
    update_num_steps: int = 1  # micro-steps of this update, the same on every rank (see below)
    update_step: int = 0  # this micro-step's position in the update, from 0
    update_tokens: int = 0  # loss-bearing tokens of the update over every rank
    update_samples: int = 0  # samples of the update over every rank
    update_short: bool = False  # the epoch's last update, closed before K steps / T tokens
    windowed: bool = False  # the daemon runs optimizer updates of several micro-steps or tokens
    # odbd --align updates (issue 26): ranks all-reduce once per update, each after its own
    # micro-steps, so update_num_steps, update_step and update_end are this rank's and differ
    # between ranks. Run every micro-step but the one with update_end under no_sync() (DDP,
    # ZeRO-1/2); FSDP and other per-layer collectives need the same micro-steps on every rank.
    update_per_rank: bool = False
    update_skip: bool = False  # a slot after the rank's last micro-step: ODBClient drops it
    update_skipped_after: int = 0  # on update_end: this rank's skipped slots after it

    def __getitem__(self, key: str) -> torch.Tensor | int:
        return self.tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def to(
        self, device: torch.device | str, *, non_blocking: bool = False
    ) -> dict[str, torch.Tensor | int]:
        """The tensors moved to `device` (e.g. `model(**batch.to("cuda"))`); ints stay."""
        return {
            k: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t
            for k, t in self.tensors.items()
        }


# Batch's fields besides its tensors and progress, in declaration order: the order
# `assemble_batch` takes them in (and the reader process's staged facts, odbclient.staging).
BATCH_FACTS = tuple(
    name for name in Batch.__dataclass_fields__ if name not in ("tensors", "progress")
)
PROGRESS_FIELDS = tuple(Progress.__dataclass_fields__)

# Slot setters (issue 15): the reader builds one Batch and one Progress per step, and a frozen
# dataclass's __init__ matches every keyword argument and sets each of its ~20 fields through
# object.__setattr__ (~4 us per step back to back, 2-3x that between the trainer's steps, with
# cold caches). Setting the slots in a loop is ~1 us. Safe: both classes have no checks or
# conversions in __init__ (no __post_init__), so the instances are the same as __init__'s.
_BATCH_SETTERS = tuple(
    Batch.__dict__[name].__set__ for name in ("tensors", "progress", *BATCH_FACTS)
)
_PROGRESS_SETTERS = tuple(Progress.__dict__[name].__set__ for name in PROGRESS_FIELDS)


def assemble_progress(values: Sequence[object]) -> Progress:
    """Progress(**dict(zip(PROGRESS_FIELDS, values))), without __init__'s keyword matching."""
    progress = object.__new__(Progress)
    for set_field, value in zip(_PROGRESS_SETTERS, values, strict=True):
        set_field(progress, value)
    return progress


def assemble_batch(
    tensors: dict[str, torch.Tensor | int], progress: Progress, facts: Sequence[object]
) -> Batch:
    """Batch(tensors=..., progress=..., **dict(zip(BATCH_FACTS, facts))), the same object
    built slot by slot (see _BATCH_SETTERS)."""
    batch = object.__new__(Batch)
    for set_field, value in zip(_BATCH_SETTERS, (tensors, progress, *facts), strict=True):
        set_field(batch, value)
    return batch
