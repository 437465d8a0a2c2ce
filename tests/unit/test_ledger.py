"""ViewLedger: every view in exactly one state; illegal transitions refused without side effects."""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from odbd.errors import ConfigError, InvariantError
from odbd.planner.ledger import ViewLedger, ViewState

P, L, B, E, R = (
    ViewState.PENDING,
    ViewState.LEASED,
    ViewState.BUFFERED,
    ViewState.EMITTED,
    ViewState.REJECTED,
)
M = ViewState.MOVED  # migration: the view's sample went to another node
# name -> (source, target): the whole transition table of the ledger
TRANSITIONS = {
    "lease": (P, L),
    "release": (L, P),
    "buffer": (L, B),
    "emit": (B, E),
    "reject": (L, R),
    "unbuffer": (B, P),
    "move_out": (B, M),
    "move_in": (P, B),
    "move_back": (M, B),
}


def make_ledger(states: list[ViewState]) -> ViewLedger:
    """A ledger whose view i is in states[i], reached by legal transitions only."""
    ledger = ViewLedger(len(states))
    by_state = {s: [i for i, x in enumerate(states) if x == s] for s in ViewState}
    ledger.lease(by_state[L] + by_state[B] + by_state[E] + by_state[R] + by_state[M])
    ledger.buffer(by_state[B] + by_state[E] + by_state[M])
    ledger.emit(by_state[E])
    ledger.move_out(by_state[M])
    ledger.reject(by_state[R])
    return ledger


def method(ledger: ViewLedger, name: str) -> Callable[[object], None]:
    return getattr(ledger, name)  # type: ignore[no-any-return]


def snapshot(ledger: ViewLedger) -> tuple[list[int], dict[ViewState, int]]:
    return ledger.state_of(np.arange(ledger.num_views)).tolist(), ledger.counts()


def test_new_ledger_has_every_view_pending() -> None:
    ledger = ViewLedger(7)
    assert ledger.counts() == {P: 7, L: 0, B: 0, E: 0, R: 0, M: 0}
    assert ledger.views_in(P).tolist() == list(range(7))
    assert ledger.views_in(P).dtype == np.int64
    ledger.check()


def test_a_moved_view_is_emitted_once_over_the_home_and_the_receiving_ledger() -> None:
    home, receiver = ViewLedger(4), ViewLedger(4)  # each node's ledger spans every view
    home.lease([0, 1])
    home.buffer([0, 1])
    home.move_out([1])
    receiver.move_in([1])
    home.emit([0])
    receiver.emit([1])
    assert home.state_of(range(4)).tolist() == [E, M, P, P]
    assert receiver.state_of(range(4)).tolist() == [P, E, P, P]
    with pytest.raises(InvariantError, match="view 1 is MOVED"):
        home.emit([1])  # the home node can never emit it too


def test_empty_ledger_is_valid() -> None:
    ledger = ViewLedger(0)
    ledger.lease([])
    assert sum(ledger.counts().values()) == 0
    ledger.check()


def test_full_life_of_views() -> None:
    ledger = ViewLedger(6)
    ledger.lease(np.array([0, 1, 2, 3, 4]))
    ledger.release([4])
    ledger.buffer([3, 0, 1])
    ledger.reject([2])
    ledger.emit([1, 0])
    ledger.unbuffer([3])
    assert ledger.state_of(range(6)).tolist() == [E, E, R, P, P, P]
    assert ledger.counts() == {P: 3, L: 0, B: 0, E: 2, R: 1, M: 0}
    assert ledger.views_in(E).tolist() == [0, 1]
    ledger.check()


@pytest.mark.parametrize("name", TRANSITIONS)
def test_each_transition_moves_views_from_source_to_target(name: str) -> None:
    source, target = TRANSITIONS[name]
    ledger = make_ledger([source] * 5)
    method(ledger, name)(np.array([4, 1, 2], dtype=np.int32))
    assert ledger.state_of([0, 1, 2, 3, 4]).tolist() == [source, target, target, source, target]
    assert ledger.count(source) == 2 and ledger.count(target) == 3
    ledger.check()


@pytest.mark.parametrize(
    ("name", "wrong"),
    [(name, s) for name, (source, _) in TRANSITIONS.items() for s in ViewState if s != source],
)
def test_transition_from_wrong_state_is_refused_without_side_effects(
    name: str, wrong: ViewState
) -> None:
    source, _ = TRANSITIONS[name]
    ledger = make_ledger([source, source, wrong, source])
    before = snapshot(ledger)
    with pytest.raises(InvariantError, match=f"view 2 is {wrong.name}"):
        method(ledger, name)([0, 2, 1])
    assert snapshot(ledger) == before
    ledger.check()


def test_error_names_at_most_five_views_with_their_states() -> None:
    ledger = make_ledger([E] * 8 + [P])
    with pytest.raises(InvariantError) as raised:
        ledger.lease(range(9))
    message = str(raised.value)
    assert "8 are not" in message
    assert message.count("is EMITTED") == 5
    assert "view 4 is EMITTED" in message and "view 5" not in message
    assert ledger.count(P) == 1 and ledger.count(E) == 8


@pytest.mark.parametrize("bad", [[0, 5], [-1], [2, 10**12]])
def test_out_of_range_views_are_refused(bad: list[int]) -> None:
    ledger = ViewLedger(5)
    with pytest.raises(InvariantError, match=r"outside \[0, 5\)"):
        ledger.lease(bad)
    assert ledger.count(P) == 5


def test_repeated_views_in_one_call_are_refused() -> None:
    ledger = ViewLedger(5)
    with pytest.raises(InvariantError, match=r"repeated in one call \(3\)"):
        ledger.lease([3, 1, 3])
    assert ledger.count(P) == 5
    ledger.check()


def test_state_of_reads_repeated_views_but_refuses_out_of_range() -> None:
    ledger = make_ledger([P, L, B])
    assert ledger.state_of([2, 2, 0]).tolist() == [B, B, P]
    with pytest.raises(InvariantError, match=r"outside \[0, 3\)"):
        ledger.state_of([3])


def test_non_integer_views_are_refused() -> None:
    ledger = ViewLedger(5)
    with pytest.raises(InvariantError, match="must be integers"):
        ledger.lease(np.array([1.0, 2.0]))
    with pytest.raises(InvariantError, match="must be integers"):
        ledger.lease(np.array([True, False]))
    assert ledger.count(P) == 5


def test_empty_transition_changes_nothing() -> None:
    ledger = ViewLedger(3)
    ledger.lease([])
    ledger.emit(np.zeros(0, dtype=np.int64))
    assert ledger.count(P) == 3


def test_check_detects_drifted_counts() -> None:
    ledger = ViewLedger(4)
    ledger._counts[int(L)] += 1  # simulate a bug that bypassed _move
    with pytest.raises(InvariantError, match="counts drifted"):
        ledger.check()


def test_state_dict_round_trips_through_json() -> None:
    ledger = make_ledger([P, L, B, E, R] * 40)
    restored = ViewLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert snapshot(restored) == snapshot(ledger)
    restored.check()
    restored.release(restored.views_in(L))  # a restored ledger keeps working
    restored.check()


def test_state_dict_of_empty_ledger_round_trips() -> None:
    restored = ViewLedger.from_state_dict(ViewLedger(0).state_dict())
    assert restored.num_views == 0
    restored.check()


@pytest.mark.parametrize(
    ("tamper", "fragment"),
    [
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d.update(num_views=3), "holds 10 states for 3 views"),
        (lambda d: d.pop("states_zlib_b64"), "unreadable"),
        (lambda d: d.update(states_zlib_b64="not base64!"), "unreadable"),
    ],
)
def test_corrupt_state_dict_raises_config_error(
    tamper: Callable[[dict[str, object]], object], fragment: str
) -> None:
    state = ViewLedger(10).state_dict()
    tamper(state)
    with pytest.raises(ConfigError, match=fragment):
        ViewLedger.from_state_dict(state)


def test_state_dict_with_unknown_state_values_raises_config_error() -> None:
    state = ViewLedger(3).state_dict()
    bad = zlib.compress(np.array([0, 7, 0], dtype=np.int8).tobytes())
    state["states_zlib_b64"] = base64.b64encode(bad).decode("ascii")
    with pytest.raises(ConfigError, match="unknown state values"):
        ViewLedger.from_state_dict(state)


NUM_VIEWS = 12


class LedgerMachine(RuleBasedStateMachine):
    """Random transition sequences against a plain-list model of the partition."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = ViewLedger(NUM_VIEWS)
        self.model = [P] * NUM_VIEWS

    @rule(data=st.data(), name=st.sampled_from(sorted(TRANSITIONS)), legal=st.booleans())
    def transition(self, data: st.DataObject, name: str, legal: bool) -> None:
        source, target = TRANSITIONS[name]
        if legal:  # bias towards legal calls so the machine reaches every state
            candidates = [v for v, s in enumerate(self.model) if s == source]
            views = (
                data.draw(st.lists(st.sampled_from(candidates), unique=True)) if candidates else []
            )
            views = data.draw(st.permutations(views))
        else:
            views = data.draw(st.lists(st.integers(-2, NUM_VIEWS + 1), max_size=6))
        ok = (
            len(set(views)) == len(views)
            and all(0 <= v < NUM_VIEWS for v in views)
            and all(self.model[v] == source for v in views)
        )
        before = snapshot(self.ledger)
        if ok:
            method(self.ledger, name)(views)
            for v in views:
                self.model[v] = target
        else:
            with pytest.raises(InvariantError):
                method(self.ledger, name)(views)
            assert snapshot(self.ledger) == before

    @rule()
    def checkpoint_and_restore(self) -> None:
        self.ledger = ViewLedger.from_state_dict(self.ledger.state_dict())

    @invariant()
    def partition_matches_model(self) -> None:
        self.ledger.check()
        assert self.ledger.state_of(range(NUM_VIEWS)).tolist() == self.model
        assert sum(self.ledger.counts().values()) == NUM_VIEWS
        for state in ViewState:
            assert self.ledger.count(state) == self.model.count(state)
            assert self.ledger.views_in(state).tolist() == [
                v for v, s in enumerate(self.model) if s == state
            ]


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
