"""Why a round is incomplete, as the hub or a relay words it when the round times out: each
missing node with the reason it reported for waiting (pure; Hub quotes it in the Abort)."""

from __future__ import annotations

from collections.abc import Callable

from odbd.round.tree import TreeLayout

Waiting = dict[int, tuple[int, str]]  # node -> (round, why it has not sent it)


def why_missing(node: int, round_index: int, waiting: Waiting, name: Callable[[int], str]) -> str:
    said = _waits_because(node, round_index, waiting)
    if said is None:
        return f"{name(node)} did not contribute"
    return f"{name(node)} did not contribute: it waits because {said}"


def why_all_missing(
    missing: list[int],
    round_index: int,
    waiting: Waiting,
    layout: TreeLayout,
    children: list[int],
    name: Callable[[int], str],
) -> str:
    """Each missing node's reason; a child relay's subtree arrives in one piece, so what
    this daemon knows is that the relay did not send it, and why nodes below it wait."""
    parts = []
    for node in missing:
        relay = next((c for c in children if node in layout.subtree(c)), node)
        said = _waits_because(node, round_index, waiting)
        if node in children and len(layout.subtree(node)) > 1:
            below = ", ".join(str(n) for n in layout.subtree(node)[1:])
            why = f": it waits because {said}" if said is not None else ""
            parts.append(
                f"{name(node)} did not send its own and its subtree's contributions "
                f"(it relays for nodes {below}; one of them may be the one that stalled){why}"
            )
        elif relay != node:
            if said is not None:
                parts.append(
                    f"{why_missing(node, round_index, waiting, name)} (below node {relay})"
                )
        else:
            parts.append(why_missing(node, round_index, waiting, name))
    return "; ".join(parts) or "no node"


def _waits_because(node: int, round_index: int, waiting: Waiting) -> str | None:
    """Why `node` said it waits in this round, if it said so for this round."""
    said = waiting.get(node)
    return said[1] if said is not None and said[0] == round_index else None
