"""SamplePlanner: samples of a known structure are encoded byte for byte as encode_into does,
with the facts inspect_sample gives, and invalid samples are rejected alike (nothing cached)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from odbclient.producer.sample_plan import SamplePlanner
from odbclient.samples import SampleForm, SampleRejected, inspect_sample
from odbclient.shm import encode_into

LENGTH, LABELS = "input_ids", "labels"


def encoded_both_ways(sample: Any, planner: SamplePlanner) -> tuple[bytes, bytes]:
    facts, plan = planner.facts(sample)
    assert facts == inspect_sample(sample, length_key=LENGTH, labels_key=LABELS)
    planned = memoryview(bytearray(facts.nbytes + 64))
    reference = memoryview(bytearray(facts.nbytes + 64))
    planner.encode(planned[: facts.nbytes], sample, plan)
    encode_into(reference[: facts.nbytes], sample)
    return bytes(planned), bytes(reference)


def text(n: int, fill: int) -> dict[str, np.ndarray]:
    labels = np.full(n, fill, np.int64)
    labels[: n // 3] = -100  # prompt tokens carry no loss
    return {LENGTH: np.full(n, fill, np.int64), LABELS: labels}


SAMPLES = {
    "fixed size, then a known structure again": [text(64, 1), text(64, 2), text(64, 3)],
    "variable lengths": [text(n, n) for n in (5, 9, 5, 300, 9)],
    "a strided array and a 0-d array": [
        {
            LENGTH: np.arange(12),
            "x": np.arange(12.0, dtype=np.float32).reshape(3, 4).T,
            "score": np.array(0.5 * i),
        }
        for i in range(3)
    ],  # fmt: skip
    "bool, float16 and an empty array": [
        {
            LENGTH: np.arange(4),
            "mask": np.arange(4) % 2 == i,
            "h": np.ones((2, 3), np.float16),
            "none": np.zeros((0, 7), np.int32),
        }
        for i in range(3)
    ],  # fmt: skip
    "a big-endian array (copied with a byte swap)": [
        {LENGTH: np.arange(6, dtype=">i8") + i} for i in range(3)
    ],
    "torch tensors (the generic path)": [
        {LENGTH: torch.arange(8) + i, "pix": torch.ones(2, 2, dtype=torch.bfloat16)}
        for i in range(3)
    ],
}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_a_planned_sample_encodes_exactly_as_encode_into(name: str) -> None:
    planner = SamplePlanner(length_key=LENGTH, labels_key=LABELS)
    for sample in SAMPLES[name]:
        planned, reference = encoded_both_ways(sample, planner)
        assert planned == reference


def test_loss_tokens_are_counted_per_sample_not_cached_with_the_structure() -> None:
    planner = SamplePlanner(length_key=LENGTH, labels_key=LABELS)
    first, second = text(30, 1), text(30, 2)
    second[LABELS][:] = -100
    assert planner.facts(first)[0].loss_tokens == 20
    assert planner.facts(second)[0].loss_tokens == 0


def test_an_invalid_structure_is_rejected_every_time_with_inspect_samples_reason() -> None:
    planner = SamplePlanner(length_key=LENGTH, labels_key=LABELS)
    bad = {LENGTH: np.zeros((1, 8), np.int64)}  # a batch of one: not 1-D
    for _ in range(2):
        with pytest.raises(SampleRejected) as caught:
            planner.facts(bad)
        assert caught.value.reason == "length_key_not_1d"


def test_a_patch_count_key_is_read_per_sample() -> None:
    form = SampleForm(patch_count_key="n")
    planner = SamplePlanner(length_key=LENGTH, labels_key=LABELS, form=form)
    counts = [planner.facts({LENGTH: np.arange(4), "n": np.array(k)})[0].patches for k in (3, 7)]
    assert counts == [3, 7]
