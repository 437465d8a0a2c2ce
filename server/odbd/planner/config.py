"""Planner settings: one frozen dataclass, validated at construction (daemon and simulate)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from odbd.errors import ConfigError
from odbd.world import World


class Grouping(StrEnum):
    """How a unit's buffer is cut into groups (one group = one rank's batch of one step)."""

    PAPER = "paper"  # ODB section 2.2: threshold carry-over with B(l) = max(L // l, 1)
    MIN_TIME = "min-time"  # fewest groups under the budget, then steps balanced by cost


class Balance(StrEnum):
    """Which buffer a rank's groups come from."""

    NODE = "node"  # pool the node's ranks' buffers and deal groups to them
    RANK = "rank"  # the paper's per-rank protocol: each rank groups its own shard


class Collate(StrEnum):
    """The form of a rank's batch, and so what a group's budget and cost count."""

    PADDED = "padded"  # rows right-padded to the longest: area = longest x count <= L
    PACKED = "packed"  # one padding-free row: sum of lengths <= L


class Attention(StrEnum):
    """--attention: what attention costs over a packed row (--collate packed only)."""

    # The kernel attends over the whole row and masks across samples (eager, sdpa without a
    # varlen path, CPU): cost grows with the row's length squared.
    DENSE = "dense"
    # The kernel computes each sample's block only (flash_attention_2/3 varlen, flex attention
    # with a document mask): cost grows with the sum of the samples' squares.
    VARLEN = "varlen"
    # Learned from the trainers' step times (--cost-model auto); varlen until then.
    AUTO = "auto"


# While the cost fit warms up under --attention auto/dense, round r caps packed rows at
# budget >> ROW_CAP_SHIFTS[r % len]: full, half and quarter rows, so the fit can tell a row's
# square from its length, and a dense kernel pays full rows' squares in a third of the rounds.
ROW_CAP_SHIFTS = (0, 1, 2)


class LossScaling(StrEnum):
    """What `loss_scale` of a (rank, step) means; DESIGN.md section 3.4."""

    EXACT = "exact"  # W * t_r / sum_r t_r with post-alignment loss-bearing token counts
    APPROX = "approx"  # as exact, with t_r estimated from the unit's pre-alignment tokens/sample
    SAMPLE = "sample"  # W * n_r / sum_r n_r
    NONE = "none"  # 1 (0 for idle fillers)


class Align(StrEnum):
    """Where ranks wait for each other (planner/update_align.py)."""

    STEPS = "steps"  # every micro-step: every rank runs every step of an update
    UPDATES = "updates"  # every optimizer update: each rank runs its own micro-steps in it


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """Step time in token-equivalents: c + max_r (a * padded_r + b * sum_i l_i^2 + p * patches_r)
    (DESIGN.md s4). Packed batches have padded_r = sum_i l_i, and varlen attention's quadratic
    term is per sample, so the same formula covers both forms; `p` weighs vision patches
    (--max-patches), ~one token's work each through the vision encoder.

    `dense_rows` (packed batches under dense attention, --attention): the kernel attends over
    the whole row, so the quadratic term is the row's square, b * padded_r^2 (measured on CPU
    with sdpa: one 4096-token packed row 1.08 s, 4 padded rows of 1024 0.42 s)."""

    a: float = 1.0
    b: float = 1.2e-5
    c: float = 1800.0
    p: float = 1.0
    dense_rows: bool = False

    def __post_init__(self) -> None:
        if min(self.a, self.b, self.c, self.p) < 0:
            raise ConfigError(f"cost model coefficients must be >= 0, got {self}")

    def work(self, padded_tokens: Any, sum_sq_lengths: Any, patches: Any = 0) -> Any:
        """One rank's compute for one group, without the per-step constant c (arrays welcome).
        With dense_rows, `padded_tokens` is the packed row's length and its square replaces
        `sum_sq_lengths`."""
        square = padded_tokens * padded_tokens if self.dense_rows else sum_sq_lengths
        return self.a * padded_tokens + self.b * square + self.p * patches

    def best_row(self) -> float:
        """The packed row length that costs least per token under dense attention: a step of
        rows of S tokens costs (c + a*S + b*S^2) / S per token, least at S = sqrt(c / b)
        (longer rows pay more attention than they save in steps); inf without a square term."""
        if not self.dense_rows or self.b <= 0.0:
            return math.inf
        return math.sqrt(self.c / self.b)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    """Everything plan_round needs; identical on every daemon (in the handshake fingerprint)."""

    world: World
    token_budget: int  # L: a group's padded area (max length x count) never exceeds it
    buffer_size: int  # samples buffered per rank before a round groups them
    grouping: Grouping = Grouping.MIN_TIME
    balance: Balance = Balance.NODE
    loss_scaling: LossScaling = LossScaling.EXACT
    cost: CostModel = field(default_factory=CostModel)
    max_steps_per_round: int = 0  # C in the paper's target T; 0 = unbounded
    seed: int = 0
    # min-time: vary group membership with (seed, round) so epochs over the same samples do not
    # repeat groups (grouping.SORT_JITTER); off = the exact sort, for comparisons in simulate.
    fresh_groups: bool = True
    # Optimizer updates (planner/windows.py): K micro-steps per update, or updates closed at
    # >= T loss-bearing tokens over every rank; 1 and 0 = every step is an update (today).
    accumulate: int = 1
    tokens_per_update: int = 0
    align: Align = Align.STEPS  # --align updates: ranks all-reduce once per update
    collate: Collate = Collate.PADDED  # packed: a group's budget is its sum of lengths
    max_patches: int = 0  # a group's vision patches (sum over its samples); 0 = no patch budget
    # --attention as given (the cost's dense_rows is what this round plans with: fixed by
    # dense/varlen, learned under auto)
    attention: Attention = Attention.VARLEN
    # A packed row's token cap this round besides the budget (0 = none): the daemon varies it
    # while --attention auto/dense warms the cost fit up (ROW_CAP_SHIFTS), so the fit sees rows
    # of several lengths, not only full ones (whose squares it could not tell from their length).
    row_cap: int = 0
    # --migrate auto: migration.py balances the nodes' buffers and holds samples over the budget
    # for company; company.py's cap then stays off in rounds with such a sample (it would hold
    # them on some nodes only and break the blocks of W that migration.py aligned).
    migrate: bool = False

    def __post_init__(self) -> None:
        if self.cost.dense_rows and self.collate is not Collate.PACKED:
            raise ConfigError(
                "a dense-row cost model (--attention dense) prices packed rows only; it needs "
                "--collate packed (padded rows pay their own padded area)"
            )
        if self.max_patches < 0:
            raise ConfigError(f"--max-patches must be >= 0 (0 = off), got {self.max_patches}")
        if self.grouping is Grouping.PAPER and (
            self.collate is Collate.PACKED or self.max_patches > 0
        ):
            raise ConfigError(
                "--grouping paper implements the paper's padded batches only; "
                "--collate packed and --max-patches need --grouping min-time (the default)"
            )
        if self.accumulate < 1:
            raise ConfigError(f"--accumulate must be >= 1 micro-steps, got {self.accumulate}")
        if self.tokens_per_update < 0:
            raise ConfigError(f"--tokens-per-update must be >= 0, got {self.tokens_per_update}")
        if self.accumulate > 1 and self.tokens_per_update > 0:
            raise ConfigError(
                f"--accumulate {self.accumulate} and --tokens-per-update "
                f"{self.tokens_per_update} both size the updates; pass one of them"
            )
        if self.align is Align.UPDATES and not self.windows:
            raise ConfigError(
                "--align updates aligns ranks at optimizer updates of several micro-steps; "
                "without --accumulate K or --tokens-per-update T every step is an update, so "
                "it would be --align steps: pass one of them, or drop --align updates"
            )
        if self.token_budget <= 0:
            raise ConfigError(
                f"token budget must be > 0, got {self.token_budget}; pass --token-budget L "
                "with the most padded tokens one rank can hold in a step"
            )
        if self.buffer_size <= 0:
            raise ConfigError(f"buffer size must be > 0, got {self.buffer_size}; pass --buffer B")
        if self.max_steps_per_round < 0:
            raise ConfigError(f"max steps per round must be >= 0, got {self.max_steps_per_round}")

    @property
    def row_budget(self) -> int:
        """A packed group's token budget this round: --token-budget, or under dense attention
        the cheapest row length per token (CostModel.best_row) when that is shorter, so rows
        are not filled to a budget where their attention costs more than the steps it saves.
        Padded groups: --token-budget."""
        if self.collate is not Collate.PACKED:
            return self.token_budget
        best = min(self.cost.best_row(), float(self.row_cap or self.token_budget))
        if best >= self.token_budget:
            return self.token_budget
        return max(int(best), 1)

    @property
    def windows(self) -> bool:
        """Updates span several steps (or are sized by tokens): batches carry update facts."""
        return self.accumulate > 1 or self.tokens_per_update > 0

    @property
    def num_units(self) -> int:
        """Units are the buffers that group independently: nodes or ranks."""
        if self.balance is Balance.NODE:
            return self.world.num_nodes
        return self.world.world_size

    @property
    def ranks_per_unit(self) -> int:
        return self.world.ranks_per_node if self.balance is Balance.NODE else 1

    def unit_ranks(self, unit: int) -> range:
        """Global ranks fed by one unit, in local order."""
        first = unit * self.ranks_per_unit
        return range(first, first + self.ranks_per_unit)

    @property
    def unit_capacity(self) -> int:
        """Samples a unit buffers before it is ready for a round."""
        return self.buffer_size * self.ranks_per_unit
