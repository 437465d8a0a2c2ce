"""Validation and shared-memory layout of a producer's samples, planned once per structure.

A structure is a sample's keys, dtypes and full shapes. Everything `inspect_sample` checks
(a dict, supported dtypes, the length key, --concat keys) and everything `encode_into` computes
(the header bytes, each array's offset, the encoded size, the schema hash) is a function of the
structure alone, so samples that share one (all fixed-size samples; variable-length text has
one per length) are checked and laid out once:

    planner = SamplePlanner(length_key="input_ids", labels_key="labels")
    facts, plan = planner.facts(sample)        # raises SampleRejected like inspect_sample
    planner.encode(lane[offset : offset + facts.nbytes], sample, plan)

Per sample only the data-dependent facts are computed (loss tokens from the labels, a patch
count read from --patch-count-key's value) and the arrays are copied. Samples holding anything
but numpy arrays (torch tensors, after as_arrays) take the generic path every time.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from odbclient.samples import (
    PLAIN_SAMPLES,
    SampleFacts,
    SampleForm,
    check_finite,
    count_loss_tokens,
    inspect_sample,
)
from odbclient.shm import encode_into, read_meta

_MAX_PLANS = 4096  # distinct structures remembered; then the cache starts over
_LITTLE_ENDIAN = sys.byteorder == "little"

_Structure = tuple[tuple[str, np.dtype, tuple[int, ...]], ...]


@dataclass(slots=True)
class SamplePlan:
    """One structure's facts and layout; `header` is filled by the first sample encoded."""

    facts: SampleFacts  # loss_tokens and a --patch-count-key count are recomputed per sample
    raw_copy: bool  # every array's bytes are its encoded bytes (native little-endian)
    header: bytes | None = None  # the encoded header, identical for the structure
    spans: list[tuple[int, int]] = field(default_factory=list)  # (start, end) per array


class SamplePlanner:
    """A producer's per-structure plans; not thread-safe (one per producer loop)."""

    def __init__(
        self, *, length_key: str, labels_key: str, form: SampleForm = PLAIN_SAMPLES
    ) -> None:
        self._length_key, self._labels_key, self._form = length_key, labels_key, form
        self._plans: dict[_Structure, SamplePlan] = {}

    def facts(self, sample: Any) -> tuple[SampleFacts, SamplePlan | None]:
        """The sample's facts, and its plan (None: encode it the generic way). Raises
        SampleRejected for an invalid sample, exactly as inspect_sample does."""
        if self._form.check_finite and isinstance(sample, Mapping):
            check_finite(sample)  # values, not structure: per sample, never cached
        structure = _structure(sample)
        if structure is None:
            return self._inspect(sample), None
        plan = self._plans.get(structure)
        if plan is None:
            plan = self._new_plan(sample, structure)
        facts = plan.facts
        labels = sample.get(self._labels_key) if self._labels_key else None
        if labels is None and not self._form.patch_count_key:
            return facts, plan
        loss_tokens = facts.length if labels is None else count_loss_tokens(labels)
        patches = facts.patches
        if self._form.patch_count_key:  # a value, not a shape: read it per sample
            patches = self._inspect(sample).patches
        return SampleFacts(
            facts.nbytes, facts.length, loss_tokens, facts.schema_hash, patches
        ), plan

    def encode(self, buf: memoryview, sample: Any, plan: SamplePlan | None) -> None:
        """Writes `sample` at the start of `buf` (facts.nbytes long), as encode_into would."""
        if plan is None or plan.header is None or not plan.raw_copy:
            encode_into(buf, sample)
            if plan is not None and plan.header is None:
                meta = read_meta(buf)
                # Up to the first array: the header and its alignment padding (unread).
                first = min((f.offset for f in meta.fields), default=meta.total_bytes)
                plan.header = bytes(buf[:first])
                plan.spans = [(f.offset, f.offset + f.nbytes) for f in meta.fields]
            return
        buf[: len(plan.header)] = plan.header
        for (start, end), array in zip(plan.spans, sample.values(), strict=True):
            if start == end:  # an empty array (memoryview cannot cast a zero in a shape)
                continue
            if array.flags.c_contiguous:
                buf[start:end] = array.data.cast("B")
            else:  # a strided view: numpy copies it element by element
                np.copyto(
                    np.frombuffer(buf, array.dtype, array.size, start).reshape(array.shape), array
                )

    def _inspect(self, sample: Any) -> SampleFacts:
        return inspect_sample(
            sample, length_key=self._length_key, labels_key=self._labels_key, form=self._form
        )

    def _new_plan(self, sample: dict[str, np.ndarray], structure: _Structure) -> SamplePlan:
        facts = self._inspect(sample)  # raises for an invalid structure: nothing is cached
        raw_copy = _LITTLE_ENDIAN and all(
            array.dtype.isnative and array.dtype.kind in "biuf" for array in sample.values()
        )
        plan = SamplePlan(facts, raw_copy)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[structure] = plan
        return plan


def _structure(sample: Any) -> _Structure | None:
    """The cache key of a dict of numpy arrays; None for anything else."""
    if type(sample) is not dict:
        return None
    out = []
    for key, value in sample.items():
        if type(value) is not np.ndarray or type(key) is not str:
            return None
        out.append((key, value.dtype, value.shape))
    return tuple(out)
