"""The relay tree of the round exchanges: who talks to whom, and how a subtree's payloads
travel in one message (pure, no I/O).

Nodes form a complete k-ary tree in node-rank order (k = --round-fanout), rooted at the hub:

    parent(i) = (i - 1) // k        children(i) = k*i + 1 .. k*i + k   (those < N)

so the hub writes to at most k children, whatever the node count, and every node knows the
whole layout from (N, k) alone: no message says who relays for whom. Each node with children
serves their Join streams (a relay); contributions go up once a relay holds its whole subtree's
(its own first, then each child's subtree in node order), and the hub's result comes down
unchanged. With k >= N - 1 the tree is the star of protocol 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from odbd.errors import ConfigError

DEFAULT_FANOUT = 4
MAX_FANOUT = 1024


@dataclass(frozen=True, slots=True)
class TreeLayout:
    num_nodes: int
    fanout: int

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ConfigError(f"number of nodes must be >= 1, got {self.num_nodes}")
        if not 1 <= self.fanout <= MAX_FANOUT:
            raise ConfigError(
                f"--round-fanout {self.fanout} is outside 1..{MAX_FANOUT}; pass how many "
                f"children one daemon relays the round exchanges for (default {DEFAULT_FANOUT})"
            )

    def parent(self, node: int) -> int | None:
        """The node `node` sends its subtree's contributions to; None for the hub (node 0)."""
        self._check(node)
        return None if node == 0 else (node - 1) // self.fanout

    def children(self, node: int) -> list[int]:
        self._check(node)
        first = self.fanout * node + 1
        return list(range(first, min(first + self.fanout, self.num_nodes)))

    def subtree(self, node: int) -> list[int]:
        """`node` and every node below it, in node order (the order payloads travel up in)."""
        found, level = [], [node]
        while level:
            found += level
            level = [c for n in level for c in self.children(n)]
        return sorted(found)

    def depth(self) -> int:
        """Hops from the deepest node to the hub (0 for one node, 1 for a star)."""
        hops, node = 0, self.num_nodes - 1
        while node:
            node, hops = (node - 1) // self.fanout, hops + 1
        return hops

    def _check(self, node: int) -> None:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} is outside 0..{self.num_nodes - 1}")


class SubtreeMismatch(ValueError):
    """A relay's contribution does not carry one payload per node of its subtree."""


def unpack_subtree(
    layout: TreeLayout, child: int, payload: bytes, subtree_payloads: Sequence[bytes]
) -> list[tuple[int, bytes]]:
    """(node, payload) for every node of `child`'s subtree, from its Contribution: a leaf sends
    its own `payload`; a relay sends `subtree_payloads`, one per node of its subtree in node
    order (and no `payload`). Raises SubtreeMismatch naming what is wrong."""
    nodes = layout.subtree(child)
    if len(nodes) == 1:
        if subtree_payloads:
            raise SubtreeMismatch(
                f"node {child} relays for no other node but sent {len(subtree_payloads)} "
                "subtree payloads"
            )
        return [(child, payload)]
    if payload or len(subtree_payloads) != len(nodes):
        raise SubtreeMismatch(
            f"node {child} relays for nodes {_span(nodes)} but sent {len(subtree_payloads)} "
            f"subtree payloads{' and a payload of its own' if payload else ''}, not one per node"
        )
    return list(zip(nodes, subtree_payloads, strict=True))


def _span(nodes: Sequence[int]) -> str:
    return ", ".join(str(n) for n in nodes)


def describe_subtree(layout: TreeLayout, node: int) -> str:
    """ " and the nodes it relays for (5, 6, 7)" or "" for a leaf: for messages about a lost
    relay, whose whole subtree is cut off with it."""
    below = layout.subtree(node)[1:]
    if not below:
        return ""
    return f" and the node{'s' if len(below) > 1 else ''} it relays for ({_span(below)})"
