"""The trainer world: W global ranks, G per node, W / G nodes (glossary: DESIGN.md section 7)."""

from __future__ import annotations

from dataclasses import dataclass

from odbd.errors import ConfigError


@dataclass(frozen=True, slots=True)
class World:
    """W global ranks laid out as `num_nodes` nodes of `ranks_per_node` consecutive ranks."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size}; pass --world W")
        if self.ranks_per_node < 1:
            raise ConfigError(
                f"ranks per node must be >= 1, got {self.ranks_per_node}; pass --nproc-per-node G"
            )
        if self.world_size % self.ranks_per_node:
            raise ConfigError(
                f"world size {self.world_size} is not divisible by ranks per node "
                f"{self.ranks_per_node}; every node must run the same number of trainer ranks"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        first = node * self.ranks_per_node
        return range(first, first + self.ranks_per_node)
