"""The work of `odbd simulate`: the production planner, the baselines, and the plan file.

Kept apart from command.py because importing the planner loads torch (its sampler matches
torch's DistributedSampler bit for bit), which the flag validation should not wait for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from odbd.errors import ConfigError
from odbd.planner.config import Align, Balance, Grouping, PlannerConfig
from odbd.planner.epoch import SimulationResult, simulate
from odbd.planner.round import RoundTrace
from odbd.simulate.baselines import fixed_batch_stats
from odbd.simulate.migration import MigrationReport, summarize_migration
from odbd.simulate.oracle import node_oracle_stats, oracle_stats
from odbd.simulate.planning_time import PlanningReport, planning_report
from odbd.simulate.report import Summary, summarize
from odbd.simulate.setup import Setup
from odbd.simulate.update_align import AlignComparison, compare_align


@dataclass(frozen=True, slots=True)
class Outcome:
    """Our run and the baselines measured on the same lengths."""

    result: SimulationResult
    ours: Summary
    baselines: tuple[tuple[str, Summary], ...]  # (name, summary) in table order
    planning: PlanningReport | None = None  # with --planning-time
    migration: MigrationReport | None = None  # with --migrate auto
    align: AlignComparison | None = None  # with --align updates: the plan timed both ways

    @property
    def num_rejected(self) -> int:
        return self.result.num_rejected

    def write_plan(self, path: str) -> None:
        write_plan(self.result, path)


def execute(setup: Setup) -> Outcome:
    """Runs the planner, then (with --compare) fixed-batch, paper and oracle baselines."""
    trace = RoundTrace() if setup.planning_time else None
    # The table keeps the step grid: with --align updates it shows the --align steps plan,
    # and the updates plan is timed beside it (update_align.compare_align).
    config = replace(setup.config, align=Align.STEPS)
    result = simulate(
        setup.lengths,
        config,
        epochs=setup.epochs,
        join=setup.join,
        patches=setup.patches,
        trace=trace,
        migration=setup.migration,
        digest=setup.digest,
    )
    ours = summarize_config(result, config)
    align = None
    if setup.config.align is Align.UPDATES:
        aligned = simulate(
            setup.lengths, setup.config, epochs=setup.epochs, join=setup.join,
            patches=setup.patches, migration=setup.migration,
        )  # fmt: skip
        align = compare_align(result, aligned, config.cost, ours.ideal_time)
    planning = planning_report(trace, setup.config) if trace is not None else None
    baselines: list[tuple[str, Summary]] = []
    for batch_size in setup.compare_batch_sizes:
        baselines.append((f"fixed-{batch_size}", fixed_batch_summary(setup, batch_size)))
    if setup.compare_batch_sizes:
        paper = paper_config(config)
        paper_result = simulate(setup.lengths, paper, epochs=setup.epochs, join=setup.join)
        baselines.append(("paper", summarize_config(paper_result, paper)))
        baselines.append(("oracle", oracle_summary(setup)))
        # With --migrate auto, also what keeping every sample on its node can reach (one
        # epoch, no vision patches: node_oracle_stats plans exactly that).
        if setup.migration is not None and setup.epochs == 1 and setup.patches is None:
            baselines.append(("node-local oracle", node_oracle_summary(setup)))
    migration = None
    if setup.migration is not None:
        migration = summarize_migration(result, setup.config.cost, setup.migration)
    return Outcome(result, ours, tuple(baselines), planning, migration=migration, align=align)


def paper_config(config: PlannerConfig) -> PlannerConfig:
    """The paper's exact algorithm: threshold grouping, each rank on its own shard."""
    return replace(config, grouping=Grouping.PAPER, balance=Balance.RANK)


def summarize_config(result: SimulationResult, config: PlannerConfig) -> Summary:
    return summarize(result.stats(), config.cost, config.token_budget, config.world.world_size)


def fixed_batch_summary(setup: Setup, batch_size: int) -> Summary:
    config = setup.config
    stats = fixed_batch_stats(
        setup.lengths,
        world_size=config.world.world_size,
        batch_size=batch_size,
        cost=config.cost,
        seed=config.seed,
        epochs=setup.epochs,
    )
    return summarize(stats, config.cost, config.token_budget, config.world.world_size)


def oracle_summary(setup: Setup) -> Summary:
    """The offline oracle (oracle.py) on the same lengths, epochs and sampler seed."""
    config = setup.config
    stats = oracle_stats(
        setup.lengths,
        world_size=config.world.world_size,
        budget=config.token_budget,
        cost=config.cost,
        seed=config.seed,
        epochs=setup.epochs,
        loss_scaling=config.loss_scaling,
    )
    return summarize(stats, config.cost, config.token_budget, config.world.world_size)


def node_oracle_summary(setup: Setup) -> Summary:
    """The offline oracle kept to each node's own views (what --migrate off can reach)."""
    config = setup.config
    stats = node_oracle_stats(
        setup.lengths,
        world_size=config.world.world_size,
        ranks_per_node=config.world.ranks_per_node,
        budget=config.token_budget,
        cost=config.cost,
        seed=config.seed,
    )
    return summarize(stats, config.cost, config.token_budget, config.world.world_size)


def write_plan(result: SimulationResult, path: str) -> None:
    """JSON lines, one per step: {"epoch", "step", "ranks": [[[sample_id, length], ...], ...]}."""
    try:
        with open(path, "w", encoding="utf-8") as out:
            for epoch, step, ranks in result.iter_steps():
                line = {"epoch": epoch, "step": step, "ranks": ranks}
                out.write(json.dumps(line, separators=(",", ":")) + "\n")
    except OSError as error:
        raise ConfigError(
            f"cannot write --plan-out {path}: {error.strerror or error}; the simulation ran "
            "but its plan was not saved. Pass a writable path"
        ) from None
