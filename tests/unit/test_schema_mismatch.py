"""A schema_mismatch names the key that differs and both shapes and dtypes (issue 10): the
daemon reads a header of the job's schema once and a mismatching sample's header on rejection.
The job's schema is the one most of a node's first samples share (issue 24, schema_vote.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from odbclient.samples import schema_difference, schema_hash
from odbclient.shm import SampleMeta, encode_into, encoded_size, read_meta
from odbd.config import DaemonConfig
from odbd.daemon.locations import Locations
from odbd.daemon.node_state import NodeState
from odbd.ingest.schema_vote import SCHEMA_VOTE_WAIT_S
from odbd.ingest.service import IngestService
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
    assert outcome.num_accepted == 2 and not outcome.rejections  # held for the schema vote
    rejected = state.close_schema_vote()  # a tie: the schema that arrived first wins
    assert [r.reason for r in rejected] == ["schema_mismatch"] and rejected[0].location
    assert rejected[0].detail.startswith(
        "key 'input_ids' is int64 of shape [1, 37] here but int64 of shape [52] in the job's "
        "schema; only the first dimension may differ between samples; the job's schema is "
        "input_ids int64[*], labels int64[*] (chosen by 1 of the first 2 samples); every sample"
    ), rejected[0].detail


def test_without_a_header_reader_the_message_stays_generic() -> None:
    config = DaemonConfig(world=World(1, 1), buffer=4, token_budget=64, dataset_size=8)
    state = NodeState(config, 8)
    keys = state.lease(producer=0, count=2, deadline=10.0)
    ones = np.ones(2, np.int64)
    hashes = np.array([1, 2], np.int64)
    locations = Locations.in_lane(0, np.array([0, 64]), np.full(2, 8))
    assert not state.commit(0, keys, locations, ones, ones, hashes).rejections
    rejected = state.close_schema_vote()
    assert rejected[0].detail.startswith("keys, dtypes or shapes differ from the job's schema")


def _commit_one_by_one(state: NodeState, hashes: list[int]) -> list:
    """Commits one sample per call (as producers do with few samples), returning every
    rejection the commits gave, held-for-the-vote rejections included."""
    out = []
    keys = state.lease(producer=0, count=len(hashes), deadline=10.0)
    for i, h in enumerate(hashes):
        where = Locations.in_lane(0, np.array([64 * (i + 1)]), np.full(1, 8))
        one = np.ones(1, np.int64)
        outcome = state.commit(0, keys[i : i + 1], where, one * 5, one, np.array([h], np.int64))
        out += outcome.rejections + outcome.voted_out
    return out


def test_an_odd_first_sample_loses_the_vote_and_every_good_sample_is_buffered() -> None:
    """Issue 24: one sample of another schema committed first used to set the job's schema and
    get every good sample rejected (1 of 400 trained)."""
    config = DaemonConfig(world=World(1, 1), buffer=4, token_budget=64, dataset_size=40)
    state = NodeState(config, 40)
    size = state._vote_size()
    assert size == 8  # two buffers of 4: no more may be leased before the vote closes
    rejected = _commit_one_by_one(state, [7] + [3] * (size - 1))
    assert state.schema_hash == 3 and state.schema_votes == (size - 1, size)
    assert [(r.identity, r.reason) for r in rejected] == [
        (int(state.identities_of(np.array([0]))[0]), "schema_mismatch")
    ]
    assert state.buffered_now() == size - 1 and not state.schema_voting


def test_the_vote_closes_with_what_it_holds_when_the_sweep_says_so() -> None:
    config = DaemonConfig(world=World(1, 1), buffer=4, token_budget=64, dataset_size=40)
    state = NodeState(config, 40)
    assert _commit_one_by_one(state, [5, 9, 9]) == []
    assert state.schema_voting and state.buffered_now() == 0
    rejected = state.close_schema_vote()
    assert state.schema_hash == 9 and [r.reason for r in rejected] == ["schema_mismatch"]
    assert state.buffered_now() == 2 and state.close_schema_vote() == []


def test_empty_samples_are_rejected_at_once_while_the_vote_is_open() -> None:
    config = DaemonConfig(world=World(1, 1), buffer=4, token_budget=64, dataset_size=40)
    state = NodeState(config, 40)
    keys = state.lease(producer=0, count=2, deadline=10.0)
    where = Locations.in_lane(0, np.array([64, 128]), np.full(2, 8))
    lengths = np.array([0, 5], np.int64)
    outcome = state.commit(0, keys, where, lengths, lengths, np.array([1, 1], np.int64))
    assert [r.reason for r in outcome.rejections] == ["zero_length"]
    assert outcome.accepted.tolist() == [False, True] and state.schema_voting


def test_the_ingest_sweep_closes_a_vote_open_for_the_wait_and_frees_the_losers() -> None:
    """A node whose valid samples are few (most rejected by producers) or slow to come would
    never reach the vote's count: the 1 s lease sweep closes it SCHEMA_VOTE_WAIT_S after it
    first saw it open."""
    config = DaemonConfig(world=World(1, 1), buffer=4, token_budget=64, dataset_size=40)
    state = NodeState(config, 40)
    assert _commit_one_by_one(state, [5, 9, 9]) == []
    dropped: list = []
    sweep = SimpleNamespace(
        _state=state, _vote_seen_s=None, _drop_voted_out=dropped.extend, _on_progress=lambda: None
    )
    IngestService.close_schema_vote(sweep, 100.0)  # type: ignore[arg-type]
    assert state.schema_voting and sweep._vote_seen_s == 100.0
    IngestService.close_schema_vote(sweep, 100.0 + SCHEMA_VOTE_WAIT_S / 2)  # type: ignore[arg-type]
    assert state.schema_voting
    IngestService.close_schema_vote(sweep, 100.0 + SCHEMA_VOTE_WAIT_S)  # type: ignore[arg-type]
    assert not state.schema_voting and state.schema_hash == 9
    assert [r.reason for r in dropped] == ["schema_mismatch"] and state.buffered_now() == 2
