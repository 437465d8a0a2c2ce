"""The hub's per-round bookkeeping: who contributed what to which round (pure, no I/O).

Each node contributes rounds strictly in order 0, 1, 2, ..., but nodes may be a round apart:
a fast node sends round k+1 while a slow one still owes round k, so several rounds are open at
once. Rounds complete in order, because a node that contributed k+1 has contributed k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class ProtocolViolation(Exception):
    """A contribution breaks the protocol (replayed, out-of-order, too large): refuse the sender."""


@dataclass(frozen=True, slots=True)
class CompletedRound:
    round_index: int
    payloads: tuple[bytes, ...]  # member -> payload, in node-rank order (every node at the hub)
    last_node: int  # whose contribution completed the round (the barrier's straggler)


class RoundTable:
    """Rounds of `members` (default: nodes 0..num_nodes-1); a relay's table holds its subtree
    (tree.py), and its rounds complete with the members' payloads in node order."""

    def __init__(
        self, num_nodes: int, max_payload_bytes: int, members: Sequence[int] | None = None
    ) -> None:
        self._members = list(members) if members is not None else list(range(num_nodes))
        self._slot = {node: i for i, node in enumerate(self._members)}
        self._num_nodes = len(self._members)
        self._max_payload_bytes = max_payload_bytes
        self._next = [0] * self._num_nodes  # slot -> the only round it may contribute next
        self._open: dict[int, list[bytes | None]] = {}  # round -> slot -> payload
        self._arrived: dict[int, int] = {}  # round -> number of contributions so far

    def next_round(self, node: int) -> int:
        return self._next[self._slot[node]]

    def open_rounds(self) -> list[int]:
        return sorted(self._open)

    def missing(self, round_index: int) -> list[int]:
        """Nodes that have not contributed `round_index` (every node if it has not started)."""
        slots = self._open.get(round_index)
        if slots is None:
            return [n for i, n in enumerate(self._members) if self._next[i] <= round_index]
        return [self._members[i] for i, payload in enumerate(slots) if payload is None]

    def straggler(self, round_index: int) -> int | None:
        """The one node an open round still waits for, if it has contributed every earlier round.

        Its result can be sent before it contributes: every other payload is known, and its
        own contributions so far leave no earlier round open for it.
        """
        slots = self._open.get(round_index)
        if slots is None or self._arrived.get(round_index, 0) != self._num_nodes - 1:
            return None
        slot = slots.index(None)
        return self._members[slot] if self._next[slot] == round_index else None

    def partial(self, round_index: int) -> tuple[bytes, ...]:
        """node -> payload of an open round, b"" for the nodes that have not contributed."""
        return tuple(p if p is not None else b"" for p in self._open[round_index])

    def add(self, node: int, round_index: int, payload: bytes) -> CompletedRound | None:
        """Records one contribution; returns the round once every member has contributed it."""
        slot = self._slot.get(node)
        if slot is None:
            raise ProtocolViolation(
                f"node {node} contributed round {round_index} here, but is not one of the nodes "
                "this daemon collects (its relay subtree)"
            )
        expected = self._next[slot]
        if round_index != expected:
            verb = "replayed" if round_index < expected else "skipped ahead to"
            raise ProtocolViolation(
                f"node {node} {verb} round {round_index}; its next round is {expected} "
                "(rounds are contributed strictly in order)"
            )
        if len(payload) > self._max_payload_bytes:
            raise ProtocolViolation(
                f"node {node}'s round {round_index} payload has {len(payload)} bytes, over the "
                f"{self._max_payload_bytes} bytes a node may send"
            )
        slots = self._open.setdefault(round_index, [None] * self._num_nodes)
        slots[slot] = payload
        self._next[slot] = round_index + 1
        arrived = self._arrived.get(round_index, 0) + 1
        if arrived < self._num_nodes:
            self._arrived[round_index] = arrived
            return None
        del self._open[round_index]
        self._arrived.pop(round_index, None)
        return CompletedRound(round_index, tuple(slots), last_node=node)  # type: ignore[arg-type]
