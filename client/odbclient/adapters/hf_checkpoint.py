"""Each rank's odbd client state inside a Hugging Face Trainer checkpoint (`ODBTrainer`) or an
Accelerate `save_state` directory (`ODBAccelerate`).

    output_dir/checkpoint-N/odbd_client_rank{R}.json
        {"format": "odbd-client-state", "version": 1, "rank": R, "world_size": W,
         "job_id": "...", "global_step": N, "client": ODBClient.state_dict()}

Written by every rank before the Trainer writes `trainer_state.json` into the same directory,
so a checkpoint that the Trainer counts as complete always holds it (Accelerate: before it
writes the model). JSON, not torch.save: a handful of ints and strings, readable by hand and
loaded without unpickling.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from odbclient.trainer.client import ODBClient

FORMAT = "odbd-client-state"
VERSION = 1


class CheckpointStateError(ValueError):
    """A checkpoint has no usable odbd client state for this rank (nothing trained)."""


@dataclass(frozen=True, slots=True)
class Writer:
    """How the refusals name the adapter that writes these files, and the user's next step."""

    adapter: str  # writes the files: "ODBTrainer"
    plain: str  # what saves checkpoints without them: "a plain transformers Trainer"
    launch: str  # how to launch W ranks, "{world}" for W
    resume_other: str  # how to resume from another checkpoint


HF_TRAINER = Writer(
    adapter="ODBTrainer",
    plain="a plain transformers Trainer",
    launch="torchrun --nproc-per-node ...",
    resume_other="resume_from_checkpoint=PATH",
)
ACCELERATE = Writer(
    adapter="ODBAccelerate",
    plain="accelerator.save_state() in a loop without ODBAccelerate",
    launch="accelerate launch --num_processes {world}",
    resume_other="accelerator.load_state(PATH)",
)


@dataclass(frozen=True, slots=True)
class ClientCheckpoint:
    rank: int
    world_size: int
    job_id: str  # the daemon's job id (its welcome), "" if it never connected
    global_step: int  # the Trainer's optimizer steps at the checkpoint
    client: dict[str, Any]  # ODBClient.state_dict()


def client_state_path(checkpoint_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(checkpoint_dir) / f"odbd_client_rank{rank}.json"


def write_client_state(checkpoint_dir: str | os.PathLike[str], state: ClientCheckpoint) -> Path:
    """Writes atomically (a temporary file renamed), so a crash never leaves half a file."""
    path = client_state_path(checkpoint_dir, state.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps({"format": FORMAT, "version": VERSION, **asdict(state)}))
    os.replace(partial, path)
    return path


def read_client_state(
    checkpoint_dir: str | os.PathLike[str],
    *,
    rank: int,
    world_size: int,
    writer: Writer = HF_TRAINER,
) -> ClientCheckpoint:
    """This rank's state from `checkpoint_dir`, checked against the resuming job's world."""
    path = client_state_path(checkpoint_dir, rank)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointStateError(
            f"{path} does not exist: checkpoint {checkpoint_dir} holds no odbd client state for "
            f"rank {rank} (it was saved by {writer.plain}, by an odbd release before "
            f"{writer.adapter} saved one, or by a job of fewer ranks), so where rank "
            f"{rank}'s odbd stream continues is unknown. Nothing was trained. Resume from a "
            f"checkpoint that {writer.adapter} of this job wrote, or start training afresh"
        ) from None
    except (OSError, ValueError) as error:
        raise CheckpointStateError(
            f"{path} cannot be read ({error}); nothing was trained. Resume from another "
            f"checkpoint of this job ({writer.resume_other}), or start training afresh"
        ) from None
    state = _parse(raw, path)
    if state.world_size != world_size or state.rank != rank:
        raise CheckpointStateError(
            f"{path} was saved by rank {state.rank} of a job of {state.world_size} ranks, but "
            f"this is rank {rank} of {world_size}: odbd's steps and loss scales are planned "
            f"for one world, so it cannot resume here. Nothing was trained. Launch "
            f"{state.world_size} ranks ({writer.launch.format(world=state.world_size)}) with "
            f"daemons started with --world {state.world_size}, or start this job afresh"
        )
    return state


def load_client_state(
    client: ODBClient,
    checkpoint_dir: str | os.PathLike[str],
    *,
    rank: int,
    world_size: int,
    writer: Writer = HF_TRAINER,
) -> ClientCheckpoint:
    """Reads and checks this rank's state, then has `client` resume there: it asks the daemon
    for the checkpoint's job when it connects (a daemon of another job refuses it)."""
    state = read_client_state(checkpoint_dir, rank=rank, world_size=world_size, writer=writer)
    if state.job_id:
        try:
            client.expect_job(state.job_id)
        except ValueError as error:
            raise CheckpointStateError(
                f"{client_state_path(checkpoint_dir, rank)} was saved by odbd job "
                f"{state.job_id!r}: {error}. Nothing was trained or loaded"
            ) from None
    client.load_state_dict(state.client)
    return state


def _parse(raw: Any, path: Path) -> ClientCheckpoint:
    fields = ("rank", "world_size", "job_id", "global_step", "client")
    if (
        not isinstance(raw, dict)
        or raw.get("format") != FORMAT
        or raw.get("version") != VERSION
        or not all(k in raw for k in fields)
        or not isinstance(raw["client"], dict)
    ):
        raise CheckpointStateError(
            f"{path} is not an odbd client state of version {VERSION} (format {FORMAT!r} with "
            f"{', '.join(fields)}); nothing was trained. It was written by another odbd "
            "release or edited: resume with the release that wrote it, or start afresh"
        )
    return ClientCheckpoint(**{k: raw[k] for k in fields})
