"""NodeState with cross-node moves (issue 26 item 1 b): a view the home node moves out is MOVED
there and BUFFERED on the receiver, which plans and emits it; over both nodes every view of
the epoch is emitted exactly once, moved back or not."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.config import DaemonConfig
from odbd.daemon.locations import Locations
from odbd.daemon.node_state import NodeState
from odbd.planner.ledger import ViewState
from odbd.planner.types import SampleTable
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


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 3), st.data())
def test_every_view_is_emitted_exactly_once_over_the_nodes_whatever_moves(
    nodes: int, data: st.DataObject
) -> None:
    # DESIGN 3.2's partition, extended to moves: over every node's ledger, each view of the
    # epoch ends EMITTED on exactly one node, however samples move (and move back) each round.
    size = 12 * nodes
    peers = tuple(f"127.0.0.1:{p}" for p in range(1, nodes + 1))
    states = [
        NodeState(
            DaemonConfig(
                world=World(nodes, 1),
                node_rank=n,
                peers=peers,
                buffer=BUFFER,
                token_budget=64,
                dataset_size=size,
            ),
            size,
        )  # fmt: skip
        for n in range(nodes)
    ]
    lane = 100
    for _ in range(40):
        for n, s in enumerate(states):
            fill(s, lane=n)
        offers = [s.offers()[0] for s in states]
        if not any(len(o.samples) for o in offers):
            break
        tables = [o.samples for o in offers]
        arriving: list[list[SampleTable]] = [[] for _ in states]
        for n, t in enumerate(tables):
            if not len(t) or nodes < 2:
                continue
            rows = data.draw(st.lists(st.integers(0, len(t) - 1), unique=True), label="moved")
            targets = data.draw(
                st.lists(st.integers(1, nodes - 1), min_size=len(rows), max_size=len(rows))
            )
            keep = np.setdiff1d(np.arange(len(t)), rows)
            for row, step in zip(rows, targets, strict=True):
                one = t.take(np.array([row]))
                states[n].move_out(one.views)
                target = (n + step) % nodes
                lane += 1
                states[target].move_in(one, Locations.in_lane(lane, np.zeros(1), np.full(1, 8)))
                arriving[target].append(one)
            tables[n] = t.take(keep)
        for n, s in enumerate(states):
            mine = SampleTable.concat_all([tables[n], *arriving[n]])
            emit = data.draw(st.lists(st.booleans(), min_size=len(mine), max_size=len(mine)))
            chosen = np.flatnonzero(np.asarray(emit, dtype=bool))
            s.mark_emitted(mine.views[chosen])
            s.return_samples(
                s.local_unit_ids()[0], mine.take(np.setdiff1d(np.arange(len(mine)), chosen))
            )
    # Flush what is left: every node emits everything it buffers, leasing the rest.
    for _ in range(4 * size):
        offered = 0
        for n, s in enumerate(states):
            fill(s, lane=n)
            for o in s.offers():
                s.mark_emitted(o.samples.views)
                offered += len(o.samples)
        if not offered:
            break
    emitted = Counter(
        v for s in states for v in s.iteration(0).ledger.views_in(ViewState.EMITTED).tolist()
    )
    assert all(c == 1 for c in emitted.values()), emitted
    assert sorted(emitted) == list(range(size))


def test_a_restart_holds_moved_views_until_it_knows_who_trained_them() -> None:
    """--state-dir with moves: node 0's journal shows it trained views 0, 1 and moved 4, 5, 8,
    9 out (plus 12, which it then trained itself); node 1 trained 4 and 5 and a view of its
    own. After restore, 8 and 9 wait (neither leased nor letting the unit go dry), the rest is
    leased again; round 0's exchange says node 1 trained 4 and 5: those become MOVED (final),
    8 and 9 are leased again, so every view is trained once over both nodes."""
    home = node(0)
    assert home.is_home(np.arange(8)).tolist() == [True, True, False, False] * 2
    trained = np.array([0, 1, 12, 6])  # 6: node 1's view that node 0's ranks trained
    moved = np.array([4, 5, 8, 9, 12])
    home.restore(trained, np.zeros(0, dtype=np.int64), 0, moved)
    assert home.num_held() == 4
    leased = home.lease(producer=0, count=1000, deadline=10.0)
    own = [k for k in range(DATASET) if k % 4 < 2]
    assert sorted(leased.tolist()) == sorted(set(own) - {0, 1, 12, 4, 5, 8, 9})
    n = len(leased)
    ones = np.ones(n, dtype=np.int64)
    home.commit(0, leased, Locations.in_lane(0, 64 * np.arange(n), np.full(n, 8)), ones, ones, ones)
    home.close_schema_vote()  # fewer samples than a vote waits for
    [unit] = home._units
    assert home.dry(unit, held=False) and not home.dry(unit)  # held: the epoch is not over
    assert home.units_ready()  # yet they do not hold round 0 up: its exchange releases them
    final, again = home.release_held(np.array([4, 5, 7]))  # 7: node 1's own, not held here
    assert (final, again) == (2, 2) and home.num_held() == 0
    assert states(home, np.array([4, 5])) == [ViewState.MOVED] * 2
    assert sorted(home.lease(producer=0, count=1000, deadline=10.0).tolist()) == [8, 9]


def _nodes(nodes: int, size: int) -> list[NodeState]:
    peers = tuple(f"127.0.0.1:{p}" for p in range(1, nodes + 1))
    return [
        NodeState(
            DaemonConfig(
                world=World(nodes, 1),
                node_rank=n,
                peers=peers,
                buffer=BUFFER,
                token_budget=64,
                dataset_size=size,
            ),
            size,
        )  # fmt: skip
        for n in range(nodes)
    ]


def _settle(s: NodeState, lane: int) -> None:
    fill(s, lane=lane)
    s.close_schema_vote()


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 3), st.data())
def test_a_restart_with_moves_trains_every_view_once_over_both_runs(
    nodes: int, data: st.DataObject
) -> None:
    # DESIGN 3.2's partition across a restart with moves: run 1 moves samples between nodes
    # (and back, and on) and emits some each round; it dies after a random round. The trained
    # prefix is the rounds before a random resume point; the journals hold every move of run 1.
    # Run 2 restores each node from its own trained views and moves, round 0 exchanges the
    # foreign views trained (release_held on their union), and every node emits the rest.
    # Over run 1's prefix and run 2, each view of the epoch is emitted exactly once.
    size = 12 * nodes
    run1 = _nodes(nodes, size)
    emitted_by_round: list[list[list[int]]] = []  # round -> node -> views emitted
    moved: list[list[int]] = [[] for _ in range(nodes)]  # node -> views it sent (journal)
    lane = 100
    for _ in range(data.draw(st.integers(1, 8), label="rounds of run 1")):
        for n, s in enumerate(run1):
            _settle(s, n)
        tables = [s.offers()[0].samples for s in run1]
        arriving: list[list[SampleTable]] = [[] for _ in run1]
        for n, t in enumerate(tables):
            if not len(t):
                continue
            rows = data.draw(st.lists(st.integers(0, len(t) - 1), unique=True), label="moved")
            for row in rows:
                one = t.take(np.array([row]))
                target = (n + data.draw(st.integers(1, nodes - 1))) % nodes
                moved[n] += one.views.tolist()
                run1[n].move_out(one.views)
                lane += 1
                run1[target].move_in(one, Locations.in_lane(lane, np.zeros(1), np.full(1, 8)))
                arriving[target].append(one)
            tables[n] = t.take(np.setdiff1d(np.arange(len(t)), rows))
        emitted_now = []
        for n, s in enumerate(run1):
            mine = SampleTable.concat_all([tables[n], *arriving[n]])
            emit = data.draw(st.lists(st.booleans(), min_size=len(mine), max_size=len(mine)))
            chosen = np.flatnonzero(np.asarray(emit, dtype=bool))
            s.mark_emitted(mine.views[chosen])
            s.return_samples(
                s.local_unit_ids()[0], mine.take(np.setdiff1d(np.arange(len(mine)), chosen))
            )
            emitted_now.append(mine.views[chosen].tolist())
        emitted_by_round.append(emitted_now)
    cut = data.draw(st.integers(0, len(emitted_by_round)), label="rounds before the resume point")
    trained = [[v for r in emitted_by_round[:cut] for v in r[n]] for n in range(nodes)]
    run2 = _nodes(nodes, size)
    foreign = []
    for n, s in enumerate(run2):
        keys = np.asarray(trained[n], dtype=np.int64)
        s.restore(keys, np.zeros(0, dtype=np.int64), 0, np.asarray(moved[n], dtype=np.int64))
        foreign.append(keys[~s.is_home(keys)])
    union = np.unique(np.concatenate(foreign))
    for s in run2:
        s.release_held(union)
    after: list[int] = []
    for _ in range(4 * size):
        offered = 0
        for n, s in enumerate(run2):
            _settle(s, n)
            for o in s.offers():
                s.mark_emitted(o.samples.views)
                after += o.samples.views.tolist()
                offered += len(o.samples)
        if not offered:
            break
    counts = Counter([v for t in trained for v in t] + after)
    assert sorted(counts) == list(range(size)), "a view was never trained"
    assert all(c == 1 for c in counts.values()), {v: c for v, c in counts.items() if c > 1}
