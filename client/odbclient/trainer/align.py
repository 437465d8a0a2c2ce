"""Where restarted ranks continue: the furthest rank's first event (no state_dict loaded).

Why: a daemon continues a rank that comes back without `load_state_dict` at the first step it
has no Delivered for, and trainers report in batches, so ranks that die together (a
`torchrun --max-restarts` restart) may have reported different steps. Continuing each at its
own would pair different steps in DDP and leave one rank with steps the others never take (its
last all_reduce waits for a rank that finished). DDP keeps ranks in step, so every rank trained
what the furthest one reported: every rank continues where the furthest continues, and the
others skip steps they already trained.

`position_of` and `agreed_resume` decide; `gather_positions` is the one collective (on
torch.distributed's default group), run once per client, at its first event, on every rank.
"""

from __future__ import annotations

from typing import NamedTuple

from odbclient.errors import ProtocolError
from odbclient.trainer.batch import Batch
from odbclient.trainer.stream import EpochEnd, JobEnd

# A position sorts as (epoch, step): an epoch's end after its steps, the job's end after all.
EPOCH_END_STEP = 2**63 - 1  # fits TrainerHello.resume_step (uint64) and an int64 tensor
JOB_END_EPOCH = 2**32 - 1  # TrainerHello.resume_epoch is uint32


class Position(NamedTuple):
    epoch: int
    step: int


NO_POSITION = Position(-1, -1)  # the rank's first event is an error: it takes part, then raises


def position_of(first_event: object) -> Position:
    """Where a rank's first event puts it."""
    if isinstance(first_event, Batch):
        return Position(first_event.epoch, first_event.step)
    if isinstance(first_event, EpochEnd):
        return Position(first_event.epoch, EPOCH_END_STEP)
    if isinstance(first_event, JobEnd):
        return Position(JOB_END_EPOCH, 0)
    return NO_POSITION


def agreed_resume(own: Position, everyone: list[Position]) -> Position | None:
    """Where this rank must reconnect to continue with the others: the furthest position of any
    rank, if it is past this rank's own; None keeps this rank's first event."""
    furthest = max(everyone)
    if own == NO_POSITION or furthest <= own:
        return None
    if furthest.epoch > JOB_END_EPOCH or furthest.step > EPOCH_END_STEP:
        raise ProtocolError(f"a rank reported an impossible position {tuple(furthest)}")
    return furthest


def distributed_world() -> int:
    """torch.distributed's world size, or 1 when it is not initialised (nothing to agree on)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def gather_positions(own: Position) -> list[Position]:
    """Every rank's position, over the default process group (a device tensor under NCCL)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(list(own), dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [Position(*(int(v) for v in t.tolist())) for t in everyone]
