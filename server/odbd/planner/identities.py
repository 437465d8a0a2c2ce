"""Distinct identities emitted per epoch, over every node, from what each node sends the hub.

EpochEnd.num_identities must count the whole job's distinct identities, but since issue 25 a
node sees only its own ranks' samples. The sampler makes this cheap: DistributedSampler pads an
iteration of N identities to M = W * ceil(N / W) views by repeating the first M - N of its order
(sampler.py), so view v of an iteration holds an identity that occurs at several views exactly
when v % N < M - N, and at most W - 1 identities do. Every other emitted view is the only view
of its identity in the iteration: counting them needs no identity at all. So each node sends,
per step of a round, how many such "single" views it emitted, and the explicit identities of
the (few) repeated ones; the hub sums the counts and unions the identities; every daemon folds
the same result into its epoch tally, so num_identities is the same number everywhere.

Exact when an epoch is one sampler iteration (join mode, the default). A --no-join epoch is a
slice of the endless stream that may straddle two iterations; an identity emitted from both
counts twice there (each node would have to send every identity to tell).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

IntArray = np.ndarray  # int64


def repeated_views(keys: IntArray, num_samples: int, views_per_iteration: int) -> np.ndarray:
    """(n,) bool: view key k (iteration * M + view) holds an identity that occurs at more than
    one view of its iteration (the tail padding's repeats and the views they repeat)."""
    if num_samples == 0 or views_per_iteration == 0:
        return np.zeros(keys.shape, dtype=bool)
    pad = views_per_iteration - num_samples
    return (keys % views_per_iteration) % num_samples < pad


@dataclass(frozen=True, slots=True)
class StepIdentities:
    """The identities a round's steps emitted, per step: `singles[i]` views of step i whose
    identity occurs at no other view of their iteration, and `repeated` the distinct (step,
    identity) pairs of the other views, rows sorted."""

    singles: IntArray  # (T,) int64
    repeated: IntArray  # (n, 2) int64: step, identity

    @property
    def num_steps(self) -> int:
        return int(self.singles.shape[0])

    def take(self, steps: IntArray) -> StepIdentities:
        """The steps `steps` (a reorder and/or a prefix), renumbered 0.. in that order."""
        steps = np.asarray(steps, dtype=np.int64)
        new_index = np.full(self.num_steps, -1, dtype=np.int64)
        new_index[steps] = np.arange(len(steps), dtype=np.int64)
        moved = new_index[self.repeated[:, 0]] if len(self.repeated) else np.zeros(0, np.int64)
        kept = moved >= 0
        rows = np.stack([moved[kept], self.repeated[kept, 1]], axis=1)
        return StepIdentities(self.singles[steps].copy(), _sorted_rows(rows))

    def of_step(self, step: int) -> tuple[int, tuple[int, ...]]:
        """Step `step`'s (singles, repeated identities): what the journal keeps per step."""
        ids = self.repeated[self.repeated[:, 0] == step, 1] if len(self.repeated) else ()
        return int(self.singles[step]), tuple(int(i) for i in ids)


def no_identities(num_steps: int) -> StepIdentities:
    return StepIdentities(np.zeros(num_steps, dtype=np.int64), np.zeros((0, 2), dtype=np.int64))


def _sorted_rows(rows: IntArray) -> IntArray:
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
    if not len(rows):
        return rows
    return np.unique(rows, axis=0)  # sorted by step, then identity; duplicates dropped


def of_steps(
    step_keys: Sequence[IntArray],
    identify: Callable[[IntArray], IntArray],
    num_samples: int,
    views_per_iteration: int,
) -> StepIdentities:
    """One node's StepIdentities from the view keys it emits at each step; `identify` maps
    keys to dataset identities (NodeState.identities_of), called on the repeated views only."""
    singles = np.zeros(len(step_keys), dtype=np.int64)
    rows: list[IntArray] = []
    for step, keys in enumerate(step_keys):
        keys = np.asarray(keys, dtype=np.int64)
        repeated = repeated_views(keys, num_samples, views_per_iteration)
        singles[step] = int(keys.size - repeated.sum())
        if repeated.any():
            ids = identify(keys[repeated])
            rows.append(np.stack([np.full(ids.shape, step, dtype=np.int64), ids], axis=1))
    if not rows:
        return StepIdentities(singles, np.zeros((0, 2), dtype=np.int64))
    return StepIdentities(singles, _sorted_rows(np.concatenate(rows)))


def unite(parts: Sequence[StepIdentities], num_steps: int) -> StepIdentities:
    """The hub's reduction: singles summed, repeated (step, identity) pairs united."""
    singles = np.zeros(num_steps, dtype=np.int64)
    for part in parts:
        singles += part.singles
    rows = [p.repeated for p in parts if len(p.repeated)]
    if not rows:
        return StepIdentities(singles, np.zeros((0, 2), dtype=np.int64))
    return StepIdentities(singles, _sorted_rows(np.concatenate(rows)))


@dataclass(slots=True)
class EpochIdentities:
    """An epoch's distinct identities so far, from the round results folded into it."""

    singles: int = 0
    repeated: set[int] = field(default_factory=set)

    @property
    def count(self) -> int:
        return self.singles + len(self.repeated)

    def fold(self, singles: int, repeated: Sequence[int]) -> None:
        self.singles += singles
        self.repeated.update(repeated)


@dataclass(frozen=True, slots=True)
class IdentitySource:
    """What a node needs to tell its views' identities: the dataset size, the views of one
    sampler iteration and the key -> identity map (NodeState.identities_of)."""

    num_samples: int
    views_per_iteration: int
    identify: Callable[[IntArray], IntArray]

    def of_steps(self, step_keys: Sequence[IntArray]) -> StepIdentities:
        return of_steps(step_keys, self.identify, self.num_samples, self.views_per_iteration)
