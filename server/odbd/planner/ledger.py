"""The view ledger: every sampler view is in exactly one state (DESIGN.md section 3.2).

    PENDING --lease--> LEASED --buffer--> BUFFERED --emit--> EMITTED
       ^                 |  |                 |  |
       +----release------+  +--reject--> REJECTED +--move_out--> MOVED
       +----------------------unbuffer--------+
    PENDING --move_in--> BUFFERED   (on the receiving node of a cross-node move)
    MOVED --move_back--> BUFFERED   (a later round moved it back to a node that held it)

Migration (planner/migration_digest.py): a node's ledger spans every node's views. The home
node moves a buffered view out (MOVED, final there, like EMITTED); the receiving node books the
same view, PENDING in its ledger since no producer of its made it, in as BUFFERED, and emits it
from there. So across the job a view is still emitted once: by the one node holding it BUFFERED.

A view leaves PENDING only by a lease and reaches EMITTED only through BUFFERED, so a view is
emitted at most once and is never lost: it is always somewhere in this partition. The ledger only
records; the ingest and round code decide when to move views. Transitions are vectorised and
atomic: on any illegal request nothing changes, because a half-applied transition would leave
views nobody owns (lost) or owned twice (duplicated).
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import numpy as np

from odbd.errors import ConfigError, InvariantError

IntArray = np.ndarray  # int64, 1-D

_STATE_DICT_VERSION = 1
_MAX_NAMED = 5  # offending views named in an error message


class ViewState(IntEnum):
    PENDING = 0  # waiting for a producer
    LEASED = 1  # a producer holds the id; back to PENDING if the lease expires
    BUFFERED = 2  # sample committed to shared memory, waiting for a round to plan it
    EMITTED = 3  # planned into a step; final
    REJECTED = 4  # bad sample (counted by reason elsewhere); final, never emitted
    MOVED = 5  # its sample went to another node's buffer (migration); final on this node


_NUM_STATES = len(ViewState)


class ViewLedger:
    """States of views 0..num_views-1 (np.int8 array) plus incremental per-state counts."""

    def __init__(self, num_views: int) -> None:
        if num_views < 0:
            raise InvariantError(f"a ledger needs num_views >= 0, got {num_views}")
        self._states = np.full(num_views, ViewState.PENDING, dtype=np.int8)
        self._counts = [0] * _NUM_STATES  # state -> number of views in it
        self._counts[ViewState.PENDING] = num_views

    @property
    def num_views(self) -> int:
        return int(self._states.shape[0])

    # -- transitions ------------------------------------------------------------------------------

    def lease(self, views: IntArray | Sequence[int]) -> None:
        """PENDING -> LEASED: a producer took the ids."""
        self._move(views, ViewState.PENDING, ViewState.LEASED, "lease")

    def release(self, views: IntArray | Sequence[int]) -> None:
        """LEASED -> PENDING: the lease expired; the views are leased again later."""
        self._move(views, ViewState.LEASED, ViewState.PENDING, "release")

    def buffer(self, views: IntArray | Sequence[int]) -> None:
        """LEASED -> BUFFERED: the sample was committed into shared memory."""
        self._move(views, ViewState.LEASED, ViewState.BUFFERED, "buffer")

    def emit(self, views: IntArray | Sequence[int]) -> None:
        """BUFFERED -> EMITTED: the sample was planned into a step."""
        self._move(views, ViewState.BUFFERED, ViewState.EMITTED, "emit")

    def reject(self, views: IntArray | Sequence[int]) -> None:
        """LEASED -> REJECTED: a bad sample; counted, never emitted."""
        self._move(views, ViewState.LEASED, ViewState.REJECTED, "reject")

    def move_out(self, views: IntArray | Sequence[int]) -> None:
        """BUFFERED -> MOVED: the sample went to another node, which emits it."""
        self._move(views, ViewState.BUFFERED, ViewState.MOVED, "move out")

    def move_in(self, views: IntArray | Sequence[int]) -> None:
        """PENDING -> BUFFERED: another node's sample arrived here (its home node moved it out)."""
        self._move(views, ViewState.PENDING, ViewState.BUFFERED, "move in")

    def move_back(self, views: IntArray | Sequence[int]) -> None:
        """MOVED -> BUFFERED: a sample this node moved out came back in a later round."""
        self._move(views, ViewState.MOVED, ViewState.BUFFERED, "move back")

    def unbuffer(self, views: IntArray | Sequence[int]) -> None:
        """BUFFERED -> PENDING: a daemon restart lost the shared-memory copy."""
        self._move(views, ViewState.BUFFERED, ViewState.PENDING, "unbuffer")

    def _move(
        self, views: IntArray | Sequence[int], source: ViewState, target: ViewState, verb: str
    ) -> None:
        ids = self._validated(views, verb)
        # Plain ints, not the IntEnum members: numpy looks an IntEnum operand up as an array-like
        # first (EnumType.__getattr__ per probe), ~2.5 us per comparison on a commit's rows.
        source_value, target_value = int(source), int(target)
        actual = self._states[ids]
        wrong = actual != source_value
        if wrong.any():
            shown_views = ids[wrong][:_MAX_NAMED].tolist()
            shown_states = actual[wrong][:_MAX_NAMED].tolist()
            named = ", ".join(
                f"view {v} is {ViewState(s).name}"
                for v, s in zip(shown_views, shown_states, strict=True)
            )
            raise InvariantError(
                f"cannot {verb} {ids.size} views: all must be {source.name}, but "
                f"{int(wrong.sum())} are not ({named}); nothing changed. A view in two places "
                "means a lost or duplicated sample: this is an odbd bug, please report it"
            )
        self._states[ids] = target_value
        self._counts[source_value] -= ids.size
        self._counts[target_value] += ids.size
        assert sum(self._counts) == self.num_views, self._counts

    def _validated(
        self, views: IntArray | Sequence[int], verb: str, *, allow_repeats: bool = False
    ) -> IntArray:
        """The ids as int64, after checking dtype, range and uniqueness (else nothing moves)."""
        raw = np.asarray(views)
        if raw.size == 0:
            return np.zeros(0, dtype=np.int64)  # np.asarray([]) is float64: no dtype check
        if raw.dtype.kind not in "iu":
            raise InvariantError(f"cannot {verb}: view ids must be integers, got {raw.dtype}")
        ids = raw.astype(np.int64, copy=False).reshape(-1)
        outside = (ids < 0) | (ids >= self.num_views)
        if outside.any():
            named = ", ".join(map(str, ids[outside][:_MAX_NAMED].tolist()))
            raise InvariantError(
                f"cannot {verb}: {int(outside.sum())} view ids are outside [0, {self.num_views}) "
                f"({named}); nothing changed. This is an odbd bug, please report it"
            )
        if allow_repeats or ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
            return ids  # strictly increasing (the usual case, e.g. views_in): no repeats, no sort
        ordered = np.sort(ids)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeated.size:
            named = ", ".join(map(str, np.unique(repeated)[:_MAX_NAMED].tolist()))
            raise InvariantError(
                f"cannot {verb}: view ids repeated in one call ({named}); nothing changed. "
                "A repeated view would be counted twice: this is an odbd bug, please report it"
            )
        return ids

    # -- queries ----------------------------------------------------------------------------------

    def count(self, state: ViewState) -> int:
        return self._counts[state]

    def counts(self) -> dict[ViewState, int]:
        return {state: self._counts[state] for state in ViewState}

    def state_of(self, views: IntArray | Sequence[int]) -> np.ndarray:
        """(n,) int8 states of the given views (compare with ViewState members)."""
        return self._states[self._validated(views, "read states", allow_repeats=True)]

    def views_in(self, state: ViewState) -> IntArray:
        """(count(state),) int64 sorted view ids currently in `state`."""
        return np.flatnonzero(self._states == state).astype(np.int64, copy=False)

    def check(self) -> None:
        """Full recount: raises InvariantError if the incremental counts drifted."""
        if (
            self._states.size
            and not 0 <= int(self._states.min()) <= int(self._states.max()) < _NUM_STATES
        ):
            raise InvariantError(f"view ledger holds unknown states: {np.unique(self._states)}")
        recount = np.bincount(self._states, minlength=_NUM_STATES).tolist()
        if recount != self._counts or sum(recount) != self.num_views:
            raise InvariantError(
                f"view ledger counts drifted: incremental {self._counts}, recount {recount}, "
                f"num_views {self.num_views}; this is an odbd bug, please report it"
            )

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable snapshot; states are runs in practice, so zlib makes them tiny."""
        packed = zlib.compress(self._states.tobytes(), level=1)
        return {
            "version": _STATE_DICT_VERSION,
            "num_views": self.num_views,
            "states_zlib_b64": base64.b64encode(packed).decode("ascii"),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ViewLedger:
        """Rebuilds a ledger; a malformed snapshot is operator input (a bad --state-dir)."""
        version = state.get("version")
        if version != _STATE_DICT_VERSION:
            raise ConfigError(
                f"view ledger checkpoint has version {version!r}, this odbd reads version "
                f"{_STATE_DICT_VERSION}; the run cannot resume from it: point --state-dir at a "
                "checkpoint written by this version, or at an empty directory to start over"
            )
        try:
            num_views = int(state["num_views"])
            raw = zlib.decompress(base64.b64decode(state["states_zlib_b64"], validate=True))
        except (KeyError, TypeError, ValueError, zlib.error) as error:
            raise _corrupt(f"unreadable ({error})") from error
        states = np.frombuffer(raw, dtype=np.int8)
        if states.size != num_views:
            raise _corrupt(f"it holds {states.size} states for {num_views} views")
        if states.size and not 0 <= int(states.min()) <= int(states.max()) < _NUM_STATES:
            raise _corrupt(f"it holds unknown state values {np.unique(states).tolist()}")
        ledger = cls(num_views)
        ledger._states[:] = states
        ledger._counts = np.bincount(states, minlength=_NUM_STATES).tolist()
        return ledger


def _corrupt(what: str) -> ConfigError:
    return ConfigError(
        f"view ledger checkpoint is corrupt: {what}; the run cannot resume from it: restore the "
        "file from a backup, or point --state-dir at an empty directory to start over"
    )
