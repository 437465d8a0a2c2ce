"""`odbd simulate`: flags, validation and output (DESIGN.md section 4).

1. parse and validate the flags into a Setup (every operator error is found here)
2. run the production planner, and with --compare the baselines (runner.py)
3. print the table or --json, and write --plan-out

Every ConfigError becomes one stderr line `odbd simulate: error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

import numpy as np

from odbd import flags
from odbd.daemon_flags import add_planner_flag
from odbd.errors import ConfigError
from odbd.planner.config import (
    Align,
    Balance,
    Collate,
    CostModel,
    Grouping,
    LossScaling,
    PlannerConfig,
)
from odbd.planner.migration import (
    DEFAULT_BYTES_PER_TOKEN,
    DEFAULT_SECONDS_PER_WORK,
    LinkModel,
    Migrate,
)
from odbd.simulate.distributions import NAMES, sample_lengths
from odbd.simulate.lengths import read_lengths_and_patches
from odbd.simulate.report import render_freshness, render_table, repeated_groups, report_json
from odbd.simulate.setup import Setup
from odbd.simulate.updates import render_updates, summarize_updates
from odbd.world import World

if TYPE_CHECKING:
    from odbd.simulate.runner import Outcome

PROG = "odbd simulate"
EXIT_USAGE = 2
DEFAULT_NUM_SAMPLES = 100_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the simulate flags to `parser` (the `odbd simulate` subparser or our own)."""
    cost = CostModel()
    source = parser.add_argument_group("sample lengths (--dist or --lengths, exactly one)")
    source.add_argument("--dist", metavar="NAME", help=f"named distribution: {', '.join(NAMES)}")
    source.add_argument(
        "--lengths", metavar="FILE", help="one token length per line; sample id = line number"
    )
    source.add_argument(
        "--num-samples",
        type=int,
        metavar="N",
        help=f"samples drawn with --dist (default {DEFAULT_NUM_SAMPLES}); with --lengths, "
        "only the first N lines (default: all)",
    )
    world = parser.add_argument_group("world and planner")
    world.add_argument("--world", type=int, default=16, metavar="W", help="DDP world")
    world.add_argument("--nproc-per-node", type=int, default=8, metavar="G", help="ranks per node")
    add_planner_flag(world, "--token-budget")
    add_planner_flag(world, "--buffer")
    add_planner_flag(world, "--grouping")
    add_planner_flag(world, "--balance")
    add_planner_flag(world, "--loss-scaling")
    add_planner_flag(world, "--join")
    world.add_argument("--epochs", type=int, default=1, metavar="E", help="trainer epochs")
    add_planner_flag(world, "--seed")
    world.add_argument(
        "--fresh-groups",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vary min-time groups with seed and round, or sort exactly",
    )
    add_planner_flag(world, "--accumulate")
    add_planner_flag(world, "--tokens-per-update")
    add_planner_flag(
        world,
        "--align",
        help="updates: also time the plan with ranks aligned at optimizer updates (issue 26)",
    )
    add_planner_flag(world, "--collate")
    add_planner_flag(
        world,
        "--max-patches",
        help="at most N vision patches per group (patch counts: --lengths' second column)",
    )
    move = parser.add_argument_group("cross-node moves (planner/migration.py)")
    add_planner_flag(
        move, "--migrate", help="auto: move samples between nodes when the link model says it pays"
    )
    add_planner_flag(move, "--link-gbps", help="each node's network bandwidth per direction, Gb/s")
    move.add_argument(
        "--token-seconds",
        type=flags.number,
        default=DEFAULT_SECONDS_PER_WORK,
        metavar="S",
        help="seconds per token-equivalent of the cost model (prices the gain of a move)",
    )
    move.add_argument(
        "--bytes-per-token",
        type=flags.number,
        default=DEFAULT_BYTES_PER_TOKEN,
        metavar="B",
        help="a sample's bytes per token (prices a move on the link)",
    )
    move.add_argument(
        "--migrate-decision",
        choices=["digest", "pooled"],
        default="digest",
        help="digest (default): the moves decided as the live daemons decide them, by the hub "
        "from every node's bucketed digest (planner/migration_digest.py); pooled: from every "
        "node's samples pooled (planner/migration.py alone, the reference)",
    )
    model = parser.add_argument_group("cost model (token-equivalents)")
    model.add_argument(
        "--cost-a", type=flags.number, metavar="A", default=cost.a, help="per padded token"
    )
    model.add_argument(
        "--cost-b", type=flags.number, metavar="B", default=cost.b, help="per length²"
    )
    model.add_argument("--cost-c", type=flags.number, metavar="C", default=cost.c, help="per step")
    model.add_argument(
        "--cost-p", type=flags.number, metavar="P", default=cost.p, help="per vision patch"
    )
    output = parser.add_argument_group("baselines and output")
    output.add_argument(
        "--compare",
        action="store_true",
        help="add fixed-batch, paper and offline-oracle baselines (same data)",
    )
    output.add_argument(
        "--compare-batch-sizes",
        default="1,4",
        metavar="BS,...",
        help="fixed batch sizes for --compare",
    )
    output.add_argument("--json", action="store_true", help="print one JSON object")
    output.add_argument(
        "--plan-out", metavar="FILE", help="write the plan as JSON lines, one per step"
    )
    output.add_argument(
        "--planning-time",
        action="store_true",
        help="report each daemon's planning time per round and the round payload bytes",
    )


def run(args: argparse.Namespace) -> int:
    """Runs a parsed `odbd simulate`; returns the exit status."""
    try:
        setup = build_setup(args)
        # Imported only after validation: the planner pulls in torch (~2 s), and a bad flag
        # should fail at once.
        from odbd.simulate.runner import execute

        outcome = execute(setup)
        _write_outputs(setup, outcome)
    except ConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def main(argv: list[str] | None = None) -> int:
    # One-line errors (exit 2) naming the closest flag on a typo; defaults shown in --help.
    parser = flags.OneLineParser(
        prog=PROG, description="Run the odbd planner over a length distribution (DESIGN.md s4)."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def build_setup(args: argparse.Namespace) -> Setup:
    """Validates every flag; raises ConfigError with the fix on the first bad one."""
    if args.epochs < 1:
        raise ConfigError(f"--epochs must be >= 1 for a simulation, got {args.epochs}")
    world = World(world_size=args.world, ranks_per_node=args.nproc_per_node)
    config = PlannerConfig(
        world=world,
        token_budget=args.token_budget,
        buffer_size=args.buffer,
        grouping=Grouping(args.grouping),
        balance=Balance(args.balance),
        loss_scaling=LossScaling(args.loss_scaling),
        cost=CostModel(a=args.cost_a, b=args.cost_b, c=args.cost_c, p=args.cost_p),
        seed=args.seed,
        fresh_groups=args.fresh_groups,
        accumulate=args.accumulate,
        tokens_per_update=args.tokens_per_update,
        align=Align(args.align),
        collate=Collate(args.collate),
        max_patches=args.max_patches,
    )
    if config.windows and not args.join:
        raise ConfigError(
            "--accumulate and --tokens-per-update need join mode (a --no-join epoch ends "
            "mid-round and would cut an update in two); drop --no-join"
        )
    migration = _migration(args, config)
    lengths, patches, source = _load_lengths(args)
    _check_batch_form(args, config, patches)
    return Setup(
        lengths=lengths,
        patches=patches,
        source=source,
        config=config,
        epochs=args.epochs,
        join=args.join,
        compare_batch_sizes=_batch_sizes(args.compare_batch_sizes) if args.compare else (),
        as_json=args.json,
        plan_out=args.plan_out,
        planning_time=args.planning_time,
        migration=migration,
        digest=args.migrate_decision == "digest",
    )


def _migration(args: argparse.Namespace, config: PlannerConfig) -> LinkModel | None:
    if Migrate(args.migrate) is Migrate.OFF:
        return None
    if config.balance is not Balance.NODE:
        raise ConfigError(
            "--migrate auto moves samples between nodes' pooled buffers, which --balance rank "
            "does not have; drop --balance rank or pass --migrate off"
        )
    return LinkModel(
        bytes_per_s=args.link_gbps * 1e9 / 8,
        seconds_per_work=args.token_seconds,
        bytes_per_token=args.bytes_per_token,
    )


def _check_batch_form(
    args: argparse.Namespace, config: PlannerConfig, patches: np.ndarray | None
) -> None:
    if config.max_patches and patches is None:
        raise ConfigError(
            f"--max-patches {config.max_patches} needs each sample's patch count: pass "
            "--lengths FILE with a second column of patch counts (LENGTH PATCHES per line)"
        )
    if args.compare and (config.collate is Collate.PACKED or config.max_patches):
        raise ConfigError(
            "--compare's baselines (fixed batches, the paper's algorithm, the offline oracle) "
            "plan padded batches without a patch budget; drop --compare, or compare "
            "--collate padded runs side by side"
        )


def _load_lengths(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray | None, str]:
    if (args.dist is None) == (args.lengths is None):
        raise ConfigError(
            "pass exactly one of --dist NAME or --lengths FILE; they say where sample lengths "
            "come from"
        )
    if args.num_samples is not None and args.num_samples < 0:
        raise ConfigError(f"--num-samples must be >= 0, got {args.num_samples}")
    if args.num_samples is not None and args.num_samples > flags.MAX_DATASET_SIZE:
        raise ConfigError(
            f"--num-samples {args.num_samples} is over {flags.MAX_DATASET_SIZE}: the simulation "
            "holds arrays of N lengths in memory; pass a smaller N"
        )
    if args.dist is not None:
        n = DEFAULT_NUM_SAMPLES if args.num_samples is None else args.num_samples
        return sample_lengths(args.dist, n, args.seed), None, f"{n:,} samples of {args.dist}"
    lengths, patches = read_lengths_and_patches(args.lengths)
    if args.num_samples is not None:
        if args.num_samples > len(lengths):
            raise ConfigError(
                f"--num-samples {args.num_samples} exceeds the {len(lengths)} lengths in "
                f"{args.lengths}; pass a smaller N or omit it to use the whole file"
            )
        lengths = lengths[: args.num_samples]
        patches = None if patches is None else patches[: args.num_samples]
    return lengths, patches, f"{len(lengths):,} samples from {args.lengths}"


def _batch_sizes(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(
            f"--compare-batch-sizes must be positive integers separated by commas "
            f"(e.g. 1,4), got {text!r}"
        )
    return tuple(dict.fromkeys(int(p) for p in parts))


def _write_outputs(setup: Setup, outcome: Outcome) -> None:
    if setup.plan_out is not None:
        outcome.write_plan(setup.plan_out)
    freshness = repeated_groups(outcome.result.iter_steps())
    if setup.as_json:
        report = report_json(outcome.ours, dict(outcome.baselines))
        if setup.epochs > 1:  # only meaningful across epochs
            report["repeated_groups"] = freshness.as_json()
        if setup.config.windows:
            report["updates"] = summarize_updates(outcome.result).as_json()
        if outcome.align is not None:
            report["align"] = outcome.align.as_json()
        if outcome.planning is not None:
            report["planning"] = outcome.planning.as_json()
        if outcome.migration is not None:
            report["migration"] = outcome.migration.as_json()
        print(json.dumps(report))
        return
    print(_header(setup, outcome.num_rejected))
    print(render_table(("odbd", outcome.ours), outcome.baselines))
    if setup.epochs > 1:
        print(render_freshness(freshness))
    if setup.config.windows:
        print(render_updates(summarize_updates(outcome.result)))
    if outcome.align is not None:
        from odbd.simulate.update_align import render_align  # the planner is loaded by now

        print(render_align(outcome.align))
    if outcome.planning is not None:
        from odbd.simulate.planning_time import render_planning  # the planner is loaded by now

        print(render_planning(outcome.planning))
    if outcome.migration is not None:
        from odbd.simulate.migration import render_migration

        print(render_migration(outcome.migration))


def _header(setup: Setup, num_rejected: int) -> str:
    c = setup.config
    mode = "join" if setup.join else "no-join"
    fresh = "on" if c.fresh_groups else "off"
    lines = [
        f"{setup.source}; world {c.world.world_size} ({c.world.num_nodes} nodes x "
        f"{c.world.ranks_per_node}), token budget {c.token_budget}, buffer {c.buffer_size}/rank",
        f"odbd: {c.collate.value} batches"
        + (f" of <= {c.max_patches} patches" if c.max_patches else "")
        + f", grouping {c.grouping.value}, balance {c.balance.value}, {mode}, "
        f"{setup.epochs} epoch(s), seed {c.seed}, fresh groups {fresh}; "
        f"cost a={c.cost.a:g} b={c.cost.b:g} c={c.cost.c:g} (token-equivalents)",
    ]
    if setup.migration is not None:
        m = setup.migration
        lines.append(
            f"migrate auto: link {m.bytes_per_s * 8 / 1e9:g} Gb/s per node, "
            f"{m.seconds_per_work:g} s per token-equivalent, {m.bytes_per_token:g} bytes/token, "
            f"decided from {'digests (as live daemons do)' if setup.digest else 'pooled offers'}"
        )
    if num_rejected:
        lines.append(f"{num_rejected} zero-length sample(s) were rejected by the planner")
    return "\n".join(lines)
