"""daemon/migration_codec.py: the migration exchange's digests and moves on the wire."""

from __future__ import annotations

import numpy as np
import pytest

from odbd.daemon import migration_codec
from odbd.daemon.migration_codec import (
    decode_digest,
    decode_moves,
    encode_digest,
    hub_migrate,
)
from odbd.daemon.payload_checks import BadPayloadError
from odbd.errors import InvariantError
from odbd.planner.migration_digest import hub_moves, node_digest, pick_moves, plan_digested
from tests.unit.planner_factories import make_config
from tests.unit.test_migration_deal import spread_offers
from tests.unit.test_planner_migration import FREE_LINK, offers_of, skewed


def test_the_hub_decides_from_digests_on_the_wire_as_from_the_digests_themselves() -> None:
    config = make_config(world=4, per_node=2, budget=4000, buffer=16)
    offers = offers_of(skewed())
    digests = [node_digest(o, config) for o in offers]
    payloads = [encode_digest(o.unit, [d]) for o, d in zip(offers, digests, strict=True)]
    for p, d in zip(payloads, digests, strict=True):
        (back,) = decode_digest(p)[1]
        for name in ("buckets", "counts", "lengths", "patches", "nbytes", "ages"):
            assert np.array_equal(getattr(back, name), getattr(d, name)), name
    assert all(len(p) < 200 for p in payloads)  # 32 samples, 2 buckets each: O(buckets)
    result = hub_migrate(payloads, config, FREE_LINK, round_index=4)
    direct = hub_moves(digests, config, FREE_LINK)
    for o in offers:  # each node reads its own section, and picks the rows plan_digested does
        round_index, (mine,) = decode_moves(result, [o.unit])
        assert round_index == 4
        want = direct.moves[o.unit]
        assert np.array_equal(mine.send_counts, want.send_counts)
        assert np.array_equal(mine.send_targets, want.send_targets)
        pick = pick_moves(o, mine, config)
        moved = set(o.samples.views[pick.send_rows].tolist())
        plan = plan_digested(offers, config, FREE_LINK)
        assert moved == set(plan.views[plan.sources == o.unit].tolist())


def test_a_digest_of_another_nodes_units_fails_the_job_naming_the_sender() -> None:
    config = make_config(world=4, per_node=2, budget=4000, buffer=16)
    offers = offers_of(skewed())
    d0 = node_digest(offers[0], config)
    payloads = [encode_digest(0, [d0]), encode_digest(1, [d0])]  # node 1 sends unit 0
    out_of_range = "node 1 sent a round 2 migration digest with a value out of range"
    with pytest.raises(BadPayloadError, match=out_of_range):
        hub_migrate(payloads, config, FREE_LINK, round_index=2)
    with pytest.raises(
        InvariantError, match="node 1 sent a round 2 payload that is not an odbd migration digest"
    ):
        hub_migrate([payloads[0], b"garbage bytes!"], config, FREE_LINK, round_index=2)


def test_round_zeros_trained_views_ride_beside_the_digest_and_a_short_section_is_refused():
    keys = np.asarray([3, 7, 1 << 40], dtype=np.int64)
    got, rest = migration_codec.split_keys(migration_codec.with_keys(keys, b"digest"))
    assert got.tolist() == keys.tolist() and rest == b"digest"
    empty, rest = migration_codec.split_keys(migration_codec.with_keys(keys[:0], b""))
    assert empty.size == 0 and rest == b""
    with pytest.raises(InvariantError, match="names 3 trained views"):
        migration_codec.split_keys(migration_codec.with_keys(keys, b"")[:-1])


def test_the_moves_payload_says_whether_the_hub_balanced_or_dealt() -> None:
    # /metrics' odbd_migration_rounds_total{decision} reads it on every node.
    config = make_config(world=8, per_node=2, budget=4096, buffer=300)
    spread = spread_offers(config, 4)
    kinds = []
    for offers, cfg in ((spread, config), (offers_of(skewed()), make_config(world=4, budget=4000))):
        digests = [node_digest(o, cfg) for o in offers]
        payloads = [encode_digest(o.unit, [d]) for o, d in zip(offers, digests, strict=True)]
        decided = hub_moves(digests, cfg, FREE_LINK)
        result = hub_migrate(payloads, cfg, FREE_LINK, round_index=1)
        kinds.append((decided.dealt, migration_codec.decision_of_moves(result)))
    assert kinds == [(True, "dealt"), (False, "balanced")]
    nothing = [
        encode_digest(u, [node_digest(o, config)]) for u, o in enumerate(offers_of([[100] * 8] * 4))
    ]
    assert migration_codec.decision_of_moves(hub_migrate(nothing, config, FREE_LINK, 1)) == "none"
