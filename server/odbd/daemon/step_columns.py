"""A round's plan as the columns its StepBatches are cut from: gathered once per unit and
round (numpy fancy indexing, bytes serialized once), so building a step reads list items and
slices bytes, with no Python object per sample."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.daemon.locations import Locations
from odbd.daemon.node_state import NodeState
from odbd.ingest.lanes import Lanes
from odbd.planner.progress import (
    ProgressColumns,
)
from odbd.planner.types import NodeRoundPlan, UnitPlan

log = logging.getLogger("odbd.round")


@dataclass(frozen=True, slots=True)
class EmittedColumns:
    """A unit's emitted samples of one round, gathered once as the StepBatch's wire arrays
    (fancy indexing); each step then slices its rows, with no Python object per sample."""

    locations: Locations  # (n,) where each sample lies, freed once its step is delivered
    segments: np.ndarray  # (n,) int64 arena segment index
    offsets: np.ndarray  # (n,) int64 byte offset in the segment
    # The StepBatch fields' packed bytes of all n rows, serialized once per round: a step's
    # field is a slice of bytes (one C call), not a numpy slice and tobytes (two) per field.
    sample_ids_bytes: bytes  # (n,) <i8 dataset identities
    segments_bytes: bytes  # (n,) <u4
    offsets_bytes: bytes  # (n,) <u8
    nbytes_bytes: bytes  # (n,) <u8

    @staticmethod
    def gather(state: NodeState, lanes: Lanes, keys: np.ndarray) -> EmittedColumns:
        locations = state.locations_of(keys).with_lane()  # its steps' frees skip the lane ids
        segments, offsets = lanes.resolve_many(locations)
        return EmittedColumns(
            locations,
            segments,
            offsets,
            state.identities_of(keys).astype("<i8").tobytes(),
            segments.astype("<u4").tobytes(),
            offsets.astype("<u8").tobytes(),
            locations.nbytes.astype("<u8").tobytes(),
        )


@dataclass(frozen=True, slots=True)
class StepColumns:
    """A round's per-(step, rank) numbers as Python lists and one unit's per-slot sums, read
    once per round: each StepBatch then reads list items, not numpy scalars and reductions."""

    loss_scale: list[list[float]]  # [step][column]: this node's ranks' columns
    num_samples: list[list[int]]  # [step][column]
    num_tokens: list[list[int]]  # [step][column]
    padded_tokens: list[list[int]]  # [step][column]
    real_tokens: list[list[int]]  # [step][column]
    global_num_samples: list[int]  # [step]
    global_num_tokens: list[int]  # [step]
    slot_sum_sq: list[float]  # [slot]: sum of squared lengths (the cost model's l^2 feature)
    slot_patches: list[float]  # [slot]: vision patches

    @staticmethod
    def of(plan: NodeRoundPlan, unit: UnitPlan, num_slots: int) -> StepColumns:
        stats = plan.stats  # this node's ranks' columns
        lengths = unit.emitted.lengths.astype(np.int64)
        return StepColumns(
            stats.loss_scale.astype(np.float64).tolist(),
            stats.num_samples.tolist(),
            stats.num_tokens.tolist(),
            stats.padded_tokens.tolist(),
            stats.real_tokens.tolist(),
            plan.global_num_samples.tolist(),
            plan.global_num_tokens.tolist(),
            slot_sums(lengths * lengths, unit.slot_offsets, num_slots),
            slot_sums(unit.emitted.patches.astype(np.int64), unit.slot_offsets, num_slots),
        )


def slot_sums(values: np.ndarray, slot_offsets: np.ndarray, num_slots: int) -> list[float]:
    """Per slot s, the sum of values[slot_offsets[s]:slot_offsets[s + 1]] (int64: exact, as
    the per-slot float sums were for any realistic lengths)."""
    cumulative = np.concatenate([np.zeros(1, np.int64), np.cumsum(values, dtype=np.int64)])
    bounds = slot_offsets[: num_slots + 1]
    return (cumulative[bounds[1:]] - cumulative[bounds[:-1]]).astype(np.float64).tolist()


def progress_messages(progress: ProgressColumns) -> list[trainer_pb2.Progress]:
    """Each step's StepBatch.progress, field by field (dataclasses.asdict deep-copies)."""
    return [
        trainer_pb2.Progress(
            epoch_steps_estimate=steps,
            epoch_steps_exact=exact,
            epoch_sample_fraction=sample_fraction,
            epoch_token_fraction=token_fraction,
            epoch_tokens=tokens,
            job_fraction=job_fraction,
            job_steps_estimate=job_steps,
        )
        for steps, exact, sample_fraction, token_fraction, tokens, job_fraction, job_steps in zip(
            progress.epoch_steps_estimate,
            progress.epoch_steps_exact,
            progress.epoch_sample_fraction,
            progress.epoch_token_fraction,
            progress.epoch_tokens,
            progress.job_fraction,
            progress.job_steps_estimate,
            strict=True,
        )
    ]
