"""A schema_mismatch names the key that differs and both shapes and dtypes (issue 10): the
daemon reads the first sample's header once and a mismatching sample's header on rejection."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from odbclient.samples import schema_difference, schema_hash
from odbclient.shm import SampleMeta, encode_into, encoded_size, read_meta
from odbd.config import DaemonConfig
from odbd.daemon.node_state import Locations, NodeState
from odbd.world import World


def meta_of(sample: dict[str, Any]) -> SampleMeta:
    buf = bytearray(encoded_size(sample))
    encode_into(memoryview(buf), sample)
    return read_meta(buf)


def ids(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def test_a_differing_key_is_named_with_both_shapes_and_dtypes() -> None:
    first = meta_of({"input_ids": ids(52), "labels": ids(52)})
    batched = meta_of({"input_ids": torch.zeros(1, 37, dtype=torch.int64), "labels": ids(37)})
    assert schema_difference(first, batched) == (
        "key 'input_ids' is int64 of shape [1, 37] here but int64 of shape [52] in the first "
        "sample; only the first dimension may differ between samples"
    )
    as_int32 = meta_of({"input_ids": ids(52), "labels": ids(52).astype(np.int32)})
    assert "key 'labels' is int32 of shape [52] here but int64 of shape [52]" in (
        schema_difference(first, as_int32)
    )


def test_extra_and_missing_keys_are_named() -> None:
    first = meta_of({"input_ids": ids(5), "labels": ids(5)})
    other = meta_of({"input_ids": ids(5), "mask": ids(5).astype(np.bool_)})
    assert schema_difference(first, other) == (
        "this sample has key 'mask' (bool of shape [5]) and lacks key 'labels' "
        "(int64 of shape [5]) unlike the first sample"
    )


def test_only_the_first_dimension_may_differ() -> None:
    first = meta_of({"input_ids": ids(5), "pixels": np.zeros((5, 3), np.float32)})
    longer = meta_of({"input_ids": ids(9), "pixels": np.zeros((9, 3), np.float32)})
    assert schema_hash(read_sample_arrays(first)) == schema_hash(read_sample_arrays(longer))
    wider = meta_of({"input_ids": ids(5), "pixels": np.zeros((5, 4), np.float32)})
    assert "key 'pixels' is float32 of shape [5, 4] here but float32 of shape [5, 3]" in (
        schema_difference(first, wider)
    )


def read_sample_arrays(meta: SampleMeta) -> dict[str, np.ndarray]:
    return {f.name: np.zeros(f.shape, f.dtype) for f in meta.fields}


def test_node_state_rejects_a_mismatch_naming_the_key_when_it_can_read_headers() -> None:
    samples = {
        0: {"input_ids": ids(52), "labels": ids(52)},
        64: {"input_ids": torch.zeros(1, 37, dtype=torch.int64), "labels": ids(37)},
    }
    config = DaemonConfig(world=World(1, 1), buffer=4, token_budget=64, dataset_size=8)
    state = NodeState(config, 8)
    state.sample_meta = lambda at: meta_of(samples[at.offset])
    keys = state.lease(producer=0, count=2, deadline=10.0)
    hashes = np.array([schema_hash(samples[0]), schema_hash(samples[64])], np.uint64).view(np.int64)
    lengths = np.array([52, 1], np.int64)
    locations = Locations.in_lane(0, np.array([0, 64]), np.full(2, 8))
    outcome = state.commit(0, keys, locations, lengths, lengths, hashes)
    rejected = outcome.rejections
    assert outcome.num_accepted == 1 and [r.reason for r in rejected] == ["schema_mismatch"]
    assert rejected[0].detail.startswith(
        "key 'input_ids' is int64 of shape [1, 37] here but int64 of shape [52] in the first "
        "sample; only the first dimension may differ between samples; every sample needs"
    ), rejected[0].detail


def test_without_a_header_reader_the_message_stays_generic() -> None:
    config = DaemonConfig(world=World(1, 1), buffer=4, token_budget=64, dataset_size=8)
    state = NodeState(config, 8)
    keys = state.lease(producer=0, count=2, deadline=10.0)
    ones = np.ones(2, np.int64)
    hashes = np.array([1, 2], np.int64)
    locations = Locations.in_lane(0, np.array([0, 64]), np.full(2, 8))
    rejected = state.commit(0, keys, locations, ones, ones, hashes).rejections
    assert rejected[0].detail.startswith("keys, dtypes or shapes differ from the first sample's")
