"""The relay tree's layout and how a subtree's payloads travel (odbd/round/tree.py, pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.config import DEFAULT_ROUND_FANOUT
from odbd.errors import ConfigError
from odbd.round.table import ProtocolViolation, RoundTable
from odbd.round.tree import (
    DEFAULT_FANOUT,
    SubtreeMismatch,
    TreeLayout,
    describe_subtree,
    unpack_subtree,
)


def test_eight_nodes_at_fanout_four_the_hub_has_four_children_and_node_1_relays_three():
    layout = TreeLayout(8, 4)
    assert layout.children(0) == [1, 2, 3, 4]
    assert layout.children(1) == [5, 6, 7]
    assert layout.children(2) == []
    assert [layout.parent(n) for n in range(8)] == [None, 0, 0, 0, 0, 1, 1, 1]
    assert layout.subtree(1) == [1, 5, 6, 7]
    assert layout.subtree(0) == list(range(8))
    assert layout.depth() == 2


def test_a_fanout_of_at_least_n_minus_1_is_the_star():
    for n in range(1, 7):
        layout = TreeLayout(n, max(n - 1, 1))
        assert layout.children(0) == list(range(1, n))
        assert all(layout.children(i) == [] for i in range(1, n))
        assert layout.depth() == (1 if n > 1 else 0)


def test_fanout_one_is_a_chain():
    layout = TreeLayout(4, 1)
    assert [layout.parent(n) for n in range(4)] == [None, 0, 1, 2]
    assert layout.subtree(1) == [1, 2, 3]
    assert layout.depth() == 3


@settings(deadline=None)  # a chain of 120 computes 120 subtrees: ~50 ms, more on a busy core
@given(st.integers(1, 120), st.integers(1, 9))
def test_every_node_but_the_hub_has_one_parent_and_subtrees_partition_the_nodes(n, k):
    layout = TreeLayout(n, k)
    assert layout.parent(0) is None
    for node in range(1, n):
        parent = layout.parent(node)
        assert parent is not None and parent < node
        assert node in layout.children(parent)
    for node in range(n):
        children = layout.children(node)
        assert len(children) <= k
        below = sorted(m for c in children for m in layout.subtree(c))
        assert layout.subtree(node) == sorted([node, *below])  # disjoint, node order
    if k == 1:
        assert layout.depth() == n - 1  # a chain
    elif n > 1:
        assert k ** (layout.depth() - 1) < n  # the levels above the last are full: log_k n
    assert len(layout.children(0)) == min(k, n - 1)


def test_bad_fanouts_and_nodes_are_refused():
    with pytest.raises(ConfigError, match="--round-fanout 0"):
        TreeLayout(4, 0)
    with pytest.raises(ValueError, match="node 4 is outside 0..3"):
        TreeLayout(4, 2).children(4)


def test_the_daemons_default_is_the_trees():
    assert DEFAULT_ROUND_FANOUT == DEFAULT_FANOUT


def test_a_leaf_sends_its_payload_and_a_relay_one_per_node_of_its_subtree():
    layout = TreeLayout(8, 4)
    assert unpack_subtree(layout, 2, b"two", []) == [(2, b"two")]
    got = unpack_subtree(layout, 1, b"", [b"a", b"b", b"c", b"d"])
    assert got == [(1, b"a"), (5, b"b"), (6, b"c"), (7, b"d")]


@pytest.mark.parametrize(
    ("child", "payload", "subtree", "match"),
    [
        (1, b"", [b"a", b"b"], "node 1 relays for nodes 1, 5, 6, 7 but sent 2 subtree"),
        (1, b"x", [b"a", b"b", b"c", b"d"], "and a payload of its own"),
        (2, b"", [b"a"], "node 2 relays for no other node but sent 1 subtree"),
    ],
)
def test_a_contribution_that_does_not_match_the_senders_subtree_is_refused(
    child, payload, subtree, match
):
    with pytest.raises(SubtreeMismatch, match=match):
        unpack_subtree(TreeLayout(8, 4), child, payload, subtree)


def test_a_lost_relay_is_described_with_the_nodes_it_cut_off():
    layout = TreeLayout(8, 4)
    assert describe_subtree(layout, 1) == " and the nodes it relays for (5, 6, 7)"
    assert describe_subtree(layout, 3) == ""
    assert describe_subtree(TreeLayout(3, 1), 1) == " and the node it relays for (2)"


def test_a_relays_table_completes_with_its_subtree_in_node_order():
    """Node 1 of 8 at fan-out 4 collects nodes 1, 5, 6, 7, whatever order they arrive in."""
    table = RoundTable(8, max_payload_bytes=100, members=[1, 5, 6, 7])
    assert table.add(6, 0, b"six") is None
    assert table.add(1, 0, b"one") is None
    assert table.missing(0) == [5, 7]
    assert table.add(7, 0, b"seven") is None
    assert table.straggler(0) == 5
    done = table.add(5, 0, b"five")
    assert done is not None and done.payloads == (b"one", b"five", b"six", b"seven")
    assert done.last_node == 5
    assert table.missing(1) == [1, 5, 6, 7]


def test_a_relays_table_refuses_a_node_outside_its_subtree():
    with pytest.raises(ProtocolViolation, match="node 2 contributed round 0 here, but is not"):
        RoundTable(8, max_payload_bytes=100, members=[1, 5, 6, 7]).add(2, 0, b"x")
