"""NodeState with cross-node moves (issue 26 item 1 b): a view the home node moves out is MOVED
there and BUFFERED on the receiver, which plans and emits it; over both nodes every view of
the epoch is emitted exactly once, moved back or not."""

from __future__ import annotations

import numpy as np

from odbd.config import DaemonConfig
from odbd.daemon.node_state import Locations, NodeState
from odbd.planner.ledger import ViewState
from odbd.world import World

BUFFER = 4
DATASET = 32


def node(rank: int) -> NodeState:
    config = DaemonConfig(
        world=World(4, 2),
        node_rank=rank,
        peers=("127.0.0.1:1", "127.0.0.1:2"),
        buffer=BUFFER,
        token_budget=64,
        dataset_size=DATASET,
    )
    return NodeState(config, DATASET)


def fill(state: NodeState, lane: int) -> np.ndarray:
    keys = state.lease(producer=0, count=1000, deadline=10.0)
    n = len(keys)
    locations = Locations.in_lane(lane, 64 * np.arange(n), np.full(n, 8))
    ones = np.ones(n, dtype=np.int64)
    state.commit(0, keys, locations, ones * 3, ones * 3, ones)
    return keys


def states(state: NodeState, keys: np.ndarray) -> list[int]:
    return state.iteration(0).ledger.state_of(keys).tolist()


def test_moved_views_are_emitted_once_by_their_new_node() -> None:
    home, receiver = node(0), node(1)
    fill(home, lane=0)
    fill(receiver, lane=1)
    [offer] = home.offers()
    sent = offer.samples.take(np.arange(2))  # the round's moves: two of home's samples
    kept = offer.samples.take(np.arange(2, len(offer.samples)))
    where = home.move_out(sent.views)
    assert where.lanes.tolist() == [0, 0]  # where home's producer wrote them: shipped from there
    assert states(home, sent.views) == [ViewState.MOVED] * 2
    # The bytes landed in the receiver's moved-in lane (9) at new offsets.
    landed = Locations.in_lane(9, np.array([0, 64]), np.full(2, 8))
    receiver.move_in(sent, landed)
    receiver.return_samples(receiver.local_unit_ids()[0], sent)  # as a plan's leftovers
    assert states(receiver, sent.views) == [ViewState.BUFFERED] * 2
    assert receiver.locations_of(sent.views).lanes.tolist() == [9, 9]
    [offer_r] = receiver.offers()
    moved_in = np.isin(sent.views, offer_r.samples.views)
    planned = offer_r.samples.views
    if not moved_in.all():  # past this round's buffer: the next offer holds them
        planned = np.concatenate([planned, receiver.offers()[0].samples.views])
    assert np.isin(sent.views, planned).all()
    receiver.mark_emitted(sent.views)
    home.mark_emitted(kept.views)
    # Over both ledgers each of these views is emitted once: home holds them MOVED (final).
    emitted = [
        v for s, keys in ((home, kept.views), (receiver, sent.views)) for v in keys.tolist()
        if s.iteration(0).ledger.state_of([v])[0] == ViewState.EMITTED
    ]  # fmt: skip
    assert sorted(emitted) == sorted(offer.samples.views.tolist())
    assert all(home.iteration(0).ledger.state_of([v])[0] != ViewState.EMITTED for v in sent.views)


def test_a_sample_moved_back_to_a_node_that_moved_it_out_is_buffered_there_again() -> None:
    home, other = node(0), node(1)
    fill(home, lane=0)
    [offer] = home.offers()
    one = offer.samples.take(np.arange(1))
    home.move_out(one.views)
    other.move_in(one, Locations.in_lane(9, np.zeros(1), np.full(1, 8)))
    other.move_out(one.views)
    home.move_in(one, Locations.in_lane(8, np.zeros(1), np.full(1, 8)))
    assert states(home, one.views) == [ViewState.BUFFERED]
    assert states(other, one.views) == [ViewState.MOVED]
    assert home.locations_of(one.views).lanes.tolist() == [8]
