"""`odbd`: the node daemon, plus `odbd simulate | demo | status`.

Every daemon flag also reads from ODBD_<FLAG> (e.g. ODBD_WORLD=16, ODBD_NO_JOIN=1 is written
ODBD_JOIN=false); a flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path

from odbd import flag_files, flags
from odbd.config import (
    DEFAULT_PADS,
    DEFAULT_ROUND_FANOUT,
    DaemonConfig,
    default_socket,
    node_rank_from_environment,
)
from odbd.daemon.socket_claim import claim_daemon_sockets
from odbd.dataset_size import dataset_size_of
from odbd.errors import ConfigError
from odbd.planner.config import Align, Attention, Balance, Collate, Grouping, LossScaling
from odbd.planner.cost_fit import CostModelMode
from odbd.world import World

EXIT_USAGE = flags.EXIT_USAGE
SUBCOMMANDS = {
    "simulate": "run the planner offline over a length distribution and compare baselines",
    "demo": "a local multi-node cluster on loopback: daemons, producers, simulated trainers",
    "status": "a live view of a running daemon, read over its unix socket",
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

USAGE = """odbd --world W --nproc-per-node G (--dataset MODULE:FACTORY | --dataset-size N) [flags]
       odbd {simulate,demo,status} [--help] ..."""
EPILOG = "commands:\n" + "".join(f"  odbd {name:9} {what}\n" for name, what in SUBCOMMANDS.items())
EPILOG += "  odbd --version  the installed odbd release\n"
EPILOG += """
environment:
  every flag also reads ODBD_<FLAG>, e.g. ODBD_WORLD=16, ODBD_JOIN=false, ODBD_PAD=input_ids=0;
  a flag on the command line wins. Booleans take true/false, 1/0, yes/no or on/off.
  Without --node-rank: NODE_RANK, GROUP_RANK, JOB_COMPLETION_INDEX or the pod ordinal of HOSTNAME.
"""


def daemon_parser() -> flags.OneLineParser:
    """The daemon's flags; each value is checked by its type function at parse time."""
    p = flags.OneLineParser(
        prog="odbd",
        usage=USAGE,
        description="online dynamic batching daemon (one per node)",
        epilog=EPILOG,
    )
    count, seconds = flags.integer, flags.seconds
    world = p.add_argument_group("world and data")
    world.add_argument(
        "--world", type=count(1), required=True, metavar="W", help="trainer DDP world size"
    )
    world.add_argument(
        "--nproc-per-node", type=count(1), required=True, metavar="G", help="trainer ranks per node"
    )
    world.add_argument(
        "--node-rank",
        type=count(0),
        metavar="N",
        help="this node's index (default: from NODE_RANK, GROUP_RANK, JOB_COMPLETION_INDEX "
        "or the pod name)",
    )
    world.add_argument(
        "--dataset", metavar="MODULE:FACTORY", help="spawn producers importing this dataset"
    )
    world.add_argument(
        "--dataset-arg",
        type=flags.key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="argument of the dataset factory (repeatable)",
    )
    world.add_argument(
        "--workers",
        type=count(0),
        default=2,
        metavar="K",
        help="producer processes to spawn with --dataset",
    )
    world.add_argument(
        "--dataset-size",
        type=count(1, flags.MAX_DATASET_SIZE),
        metavar="N",
        help="dataset length, with external producers (instead of --dataset)",
    )
    plan = p.add_argument_group("batching")
    # --token-budget and --buffer: PlannerConfig checks them (> 0) with messages naming the flag.
    plan.add_argument(
        "--token-budget",
        type=flags.any_integer,
        default=12288,
        metavar="L",
        help="padded tokens per group",
    )
    plan.add_argument(
        "--buffer",
        type=flags.any_integer,
        default=1024,
        metavar="B",
        help="samples buffered per rank",
    )
    plan.add_argument(
        "--seed",
        type=count(0, flags.MAX_SEED),
        default=0,
        metavar="S",
        help="sampler seed (as DistributedSampler)",
    )
    plan.add_argument("--epochs", type=count(0), default=1, metavar="E", help="0 = endless")
    plan.add_argument(
        "--max-updates",
        type=count(0),
        default=0,
        metavar="N",
        help="end the job after exactly N optimizer updates (= steps without --accumulate) on "
        "every rank, looping over epochs, each reshuffled (0 = off; --epochs then defaults to 0)",
    )
    plan.add_argument(
        "--join",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="join: every identity each epoch; no-join: sample quota",
    )
    plan.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shuffle like DistributedSampler(shuffle=True)",
    )
    plan.add_argument(
        "--loss-scaling",
        type=flags.choice_of([m.value for m in LossScaling]),
        default="exact",
        metavar=_choices(LossScaling),
        help="how per-rank losses are scaled",
    )
    plan.add_argument(
        "--grouping",
        type=flags.choice_of([g.value for g in Grouping]),
        default="min-time",
        metavar=_choices(Grouping),
        help="how samples are grouped into steps",
    )
    plan.add_argument(
        "--cost-model",
        type=flags.choice_of([m.value for m in CostModelMode]),
        default="auto",
        metavar=_choices(CostModelMode),
        help="auto: fit the planner's step cost to the step times trainers report "
        "(ODBClient.report_compute) once warmed up, fixed until then; fixed: never",
    )
    plan.add_argument(
        "--cost-warmup",
        type=count(3),
        default=64,
        metavar="N",
        help="--cost-model auto: timed rank-steps (over every node) before the first fit; "
        "fewer lets a short job plan with its own costs sooner, on a noisier fit",
    )
    plan.add_argument(
        "--balance",
        type=flags.choice_of([b.value for b in Balance]),
        default="node",
        metavar=_choices(Balance),
        help="pool a node's buffers or keep per-rank buffers",
    )
    plan.add_argument(
        "--migrate",
        type=flags.choice_of(["auto", "off"]),
        default="off",
        metavar="{auto,off}",
        help="auto: move samples between nodes when the link model says it lowers the round's "
        "time (issue 26; docs/bench/migration.md; a --state-dir restart stays exact); off "
        "(default until make test and make soak pass with auto as the default): every sample "
        "trains on the node whose producers made it",
    )
    plan.add_argument(
        "--link-gbps",
        type=float,
        default=8.0,
        metavar="GBPS",
        help="--migrate auto: each node's bulk bandwidth per direction, Gb/s (default 8: one "
        "loopback gRPC stream measured 9.0 Gb/s on the reference machine)",
    )
    plan.add_argument(
        "--length-key",
        type=flags.nonempty,
        default="input_ids",
        metavar="KEY",
        help="key whose length is the sample's token count",
    )
    plan.add_argument(
        "--labels-key",
        type=flags.nonempty,
        default="labels",
        metavar="KEY",
        help="key whose -100 entries carry no loss",
    )
    plan.add_argument(
        "--pad",
        type=flags.key_number,
        action="append",
        default=[],
        metavar="KEY=NUMBER",
        help="pad value of a key (labels=-100 is built in; repeatable)",
    )
    plan.add_argument(
        "--max-reject-fraction",
        type=flags.fraction,
        default=0.01,
        metavar="F",
        help="fail the job once an epoch rejects more than F of its samples over every node "
        "(counts per reason, first ids and the fix in one line); 0 = any rejection fails, "
        "1 = never",
    )
    plan.add_argument(
        "--check-finite",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="producers reject (reason non_finite) a sample whose float keys hold NaN or inf",
    )
    plan.add_argument(
        "--steps-ahead",
        type=count(1),
        default=64,
        metavar="K",
        help="plan the next round once a rank has at most K steps queued",
    )
    plan.add_argument(
        "--accumulate",
        type=count(1),
        default=1,
        metavar="K",
        help="K micro-steps per optimizer update on every rank (batch.update_end marks the last)",
    )
    plan.add_argument(
        "--tokens-per-update",
        type=count(0),
        default=0,
        metavar="T",
        help="close an update once its micro-steps hold >= T loss-bearing tokens over all ranks "
        "(0 = off; excludes --accumulate)",
    )
    plan.add_argument(
        "--align",
        type=flags.choice_of([a.value for a in Align]),
        default="steps",
        metavar=_choices(Align),
        help="where ranks wait for each other: every micro-step (steps), or once per optimizer "
        "update, each rank running its own micro-steps (updates; needs --accumulate or "
        "--tokens-per-update, and DDP or ZeRO-1/2, not FSDP: docs/training.md)",
    )
    plan.add_argument(
        "--collate",
        type=flags.choice_of([c.value for c in Collate]),
        default="padded",
        metavar=_choices(Collate),
        help="padded: rows padded per --pad, area longest x count <= L; packed: one padding-free "
        "row per rank-step with position_ids and cu_seq_lens (Hugging Face padding-free), "
        "sum of lengths <= L",
    )
    plan.add_argument(
        "--attention",
        type=flags.choice_of([a.value for a in Attention]),
        default="auto",
        metavar=_choices(Attention),
        help="--collate packed: what a packed row's attention costs. dense: over the whole row "
        "(eager/sdpa, CPU; rows are then cut at the cheapest length per token); varlen: per "
        "sample (flash_attention_2, flex document masks); auto: learned from the step times "
        "trainers report (--cost-model auto), varlen until then",
    )
    plan.add_argument(
        "--concat",
        type=flags.key_list,
        action="append",
        default=[],
        metavar="KEY",
        help="join KEY along its first dimension (e.g. pixel_values [patches, dim]) with "
        "KEY_offsets per sample, instead of padding or stacking it (repeatable, or KEY,KEY)",
    )
    plan.add_argument(
        "--max-patches",
        type=count(0),
        default=0,
        metavar="N",
        help="at most N vision patches per group beside the token budget (0 = off; needs "
        "--patch-key, --patch-count-key or a --concat key)",
    )
    plan.add_argument(
        "--patch-key",
        type=flags.nonempty,
        default=None,
        metavar="KEY",
        help="a sample's patch count is KEY's first dimension (default: the first --concat key)",
    )
    plan.add_argument(
        "--patch-count-key",
        type=flags.nonempty,
        default=None,
        metavar="KEY",
        help="a sample's patch count is the integer value of KEY (instead of --patch-key)",
    )
    net = p.add_argument_group("sockets and network")
    net.add_argument(
        "--socket",
        type=flags.socket_path,
        default=default_socket(),
        metavar="PATH",
        help="unix socket of trainers and producers (mode 0600); its directory must exist "
        "(the default's is created mode 0700, and refused if another user owns it or others "
        "can write it)",
    )
    net.add_argument(
        "--peers",
        type=flags.host_port_list,
        default=(),
        metavar="H:P,...",
        help="peer daemons in node-rank order (multi-node)",
    )
    net.add_argument(
        "--listen",
        type=flags.host_port,
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="peer gRPC listener",
    )
    net.add_argument(
        "--metrics-port",
        type=count(0, 65535),
        metavar="P",
        help="serve Prometheus /metrics on this port (0 = any free port)",
    )
    net.add_argument(
        "--metrics-host",
        type=flags.nonempty,
        default="127.0.0.1",
        metavar="HOST",
        help="address /metrics binds",
    )
    net.add_argument(
        "--health-listen",
        type=flags.optional_host_port,
        default="",
        metavar="HOST:PORT",
        help="grpc.health.v1 over TCP; empty = socket only",
    )
    safety = p.add_argument_group("timeouts, state and security")
    safety.add_argument(
        "--lease-timeout",
        type=seconds(allow_zero=False),
        default=60.0,
        metavar="S",
        help="a producer's lease expires after S without a commit; a --workers process "
        "inside one dataset[i] for S is killed as hung",
    )
    safety.add_argument(
        "--round-timeout",
        type=seconds(allow_zero=False),
        default=300.0,
        metavar="S",
        help="a round's contributions arrive within S",
    )
    safety.add_argument(
        "--round-fanout",
        type=int,
        default=DEFAULT_ROUND_FANOUT,
        metavar="K",
        help="children per daemon in the relay tree of the round exchanges: node 0 writes to "
        f"at most K daemons, each relaying for at most K more (default {DEFAULT_ROUND_FANOUT}; the "
        "same on every daemon)",
    )
    safety.add_argument(
        "--join-timeout",
        type=seconds(allow_zero=False),
        default=120.0,
        metavar="S",
        help="every daemon joins the job within S",
    )
    safety.add_argument(
        "--drain-timeout",
        type=seconds(allow_zero=True),
        default=30.0,
        metavar="S",
        help="SIGTERM grace period",
    )
    safety.add_argument(
        "--attach-timeout",
        type=seconds(allow_zero=False),
        default=1800.0,
        metavar="S",
        help="a local rank not attached this long (from start-up or its detach) fails the job; "
        "generous because loading a model can take many minutes. The job ends only once "
        "every local rank took its end (no fixed grace)",
    )
    safety.add_argument(
        "--end-timeout",
        type=seconds(allow_zero=False),
        default=60.0,
        metavar="S",
        help="once a rank called ODBClient.end_job(), every rank must call it within S, else "
        "the job fails naming the ranks that did not",
    )
    safety.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="journal directory for restarts (created if missing)",
    )
    safety.add_argument(
        "--rewind-steps",
        type=count(0),
        default=4096,
        metavar="N",
        help="steps per rank the daemon keeps (ids, not samples) so a trainer restarted from an "
        "older checkpoint gets the same steps again on the running daemon; a resume point "
        "older than that is refused by name. About 200 bytes + 28 per sample per rank-step",
    )
    safety.add_argument(
        "--job-id",
        type=flags.nonempty,
        default="odbd",
        metavar="ID",
        help="names the job's shm segments; peers must match",
    )
    safety.add_argument(
        "--job-token-file",
        type=Path,
        metavar="FILE",
        help="shared secret of the job's daemons (non-empty, e.g. openssl rand -hex 32); "
        "peers prove it by challenge-response, it never crosses the network",
    )
    safety.add_argument(
        "--tls-cert", type=Path, metavar="PEM", help="peer mTLS: this daemon's certificate"
    )
    safety.add_argument("--tls-key", type=Path, metavar="PEM", help="peer mTLS: its private key")
    safety.add_argument(
        "--tls-ca", type=Path, metavar="PEM", help="peer mTLS: CA that signs every daemon"
    )
    safety.add_argument(
        "--insecure",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let a multi-node daemon on a non-loopback address run without a job token or "
        "mTLS (only on an isolated network where every host is trusted)",
    )
    safety.add_argument(
        "--shm-size",
        type=flags.size_bytes,
        default="1G",
        metavar="BYTES",
        help="shared memory arena, e.g. 512M, 4G",
    )
    safety.add_argument(
        "--log-level",
        type=flags.choice_of(LOG_LEVELS, upper=True),
        default="INFO",
        metavar="LEVEL",
        help=", ".join(LOG_LEVELS),
    )
    return p


def _choices(enum: type[StrEnum]) -> str:
    return "{" + ",".join(member.value for member in enum) + "}"


def flags_markdown() -> str:
    """The "Flags and environment" table of server/README.md, generated from the parser."""
    rows = ["| flag | default | environment | meaning |", "| --- | --- | --- | --- |"]
    for action in daemon_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        metavar = f" {action.metavar}" if action.metavar else ""
        names = " / ".join(f"`{name}{metavar}`" for name in action.option_strings)
        rows.append(f"| {names} | {_default_text(action)} | `{env_name(action)}` | {action.help} |")
    return "\n".join(rows) + "\n"


def _default_text(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.default is None or action.default in ("", (), []):
        return "-"
    if action.default == default_socket():
        return "`$XDG_RUNTIME_DIR/odbd/odbd.sock`, else `/tmp/odbd-$UID/odbd.sock`"
    return f"`{action.default}`"


def apply_environment(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """ODBD_<FLAG> values become defaults, so the command line still wins.

    Each value goes through its flag's own type check; a bad one is a one-line error naming
    the variable (exit 2), never silently read (ODBD_JOIN=maybe is not false).
    """
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = env_name(action)
        if name not in environ:
            continue
        raw = environ[name]
        parse = flags.boolean if isinstance(action, argparse.BooleanOptionalAction) else action.type
        try:
            value = parse(raw) if callable(parse) else raw
        except (ValueError, argparse.ArgumentTypeError) as error:
            parser.error(f"{name}={raw!r}: {error}")
        if isinstance(action, argparse._AppendAction):
            value = [value]
        action.default = value
        action.required = False


def refuse_misspelt_variables(parser: flags.OneLineParser, environ: Mapping[str, str]) -> None:
    """An ODBD_* name that is almost a flag's (ODBD_WROLD) or a negated boolean (ODBD_NO_JOIN)
    would be ignored silently and the daemon would run with the default: refuse it instead.
    Other ODBD_* names (the benchmarks' settings, say) are not the daemon's business."""
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    known = {env_name(a) for a in actions}
    negated = {
        "ODBD_NO_" + a.dest.upper(): env_name(a)
        for a in actions
        if isinstance(a, argparse.BooleanOptionalAction)
    }
    for name in sorted(n for n in environ if n.startswith("ODBD_") and n not in known):
        if name in negated:
            parser.error(f"{name} is not read; write {negated[name]}=false instead")
        match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
        if match:
            parser.error(f"{name} is not a flag's variable; did you mean {match[0]}?")


def env_name(action: argparse.Action) -> str:
    return "ODBD_" + action.dest.upper()


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> DaemonConfig:
    """The DaemonConfig of parsed flags; reads the files the flags name, checks the paths."""
    node_rank = args.node_rank
    if node_rank is None:
        node_rank = node_rank_from_environment(environ)
    flag_files.check_socket_directory(args.socket)
    if args.state_dir is not None:
        flag_files.check_state_dir(args.state_dir)
    pads = dict(DEFAULT_PADS) | dict(args.pad)
    return DaemonConfig(
        world=_world(args.world, args.nproc_per_node),
        node_rank=node_rank,
        peers=args.peers,
        listen=args.listen,
        socket=args.socket,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        health_listen=args.health_listen,
        drain_timeout_s=args.drain_timeout,
        attach_timeout_s=args.attach_timeout,
        end_timeout_s=args.end_timeout,
        dataset=args.dataset,
        dataset_args=tuple(args.dataset_arg),
        workers=args.workers,
        dataset_size=args.dataset_size,
        token_budget=args.token_budget,
        buffer=args.buffer,
        seed=args.seed,
        epochs=args.epochs,
        max_updates=args.max_updates,
        join=args.join,
        shuffle=args.shuffle,
        loss_scaling=LossScaling(args.loss_scaling),
        grouping=Grouping(args.grouping),
        cost_model=CostModelMode(args.cost_model),
        balance=Balance(args.balance),
        migrate=args.migrate == "auto",
        link_gbps=args.link_gbps,
        length_key=args.length_key,
        labels_key=args.labels_key,
        pads=tuple(pads.items()),
        state_dir=args.state_dir,
        job_id=args.job_id,
        job_token=flag_files.read_job_token(args.job_token_file),
        peer_tls=flag_files.read_peer_tls(args.tls_cert, args.tls_key, args.tls_ca),
        insecure=args.insecure,
        shm_size=args.shm_size,
        lease_timeout_s=args.lease_timeout,
        round_timeout_s=args.round_timeout,
        round_fanout=args.round_fanout,
        join_timeout_s=args.join_timeout,
        steps_ahead=args.steps_ahead,
        rewind_steps=args.rewind_steps,
        max_reject_fraction=args.max_reject_fraction,
        check_finite=args.check_finite,
        accumulate=args.accumulate,
        tokens_per_update=args.tokens_per_update,
        align=Align(args.align),
        collate=Collate(args.collate),
        attention=Attention(args.attention),
        cost_warmup=args.cost_warmup,
        concat=tuple(key for keys in args.concat for key in keys),
        max_patches=args.max_patches,
        patch_key=args.patch_key,
        patch_count_key=args.patch_count_key,
    )


def _world(world_size: int, ranks_per_node: int) -> World:
    try:
        return World(world_size, ranks_per_node)
    except ConfigError as error:
        raise ConfigError(
            f"--world {world_size} --nproc-per-node {ranks_per_node}: {error}"
        ) from None


def run_daemon_command(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """Parses and checks everything (exit 2 with one line on a bad input), then runs the daemon."""
    env = dict(os.environ) if environ is None else dict(environ)
    parser = daemon_parser()
    refuse_misspelt_variables(parser, env)
    apply_environment(parser, env)
    args = parser.parse_args(list(argv))
    default_epochs_for_max_updates(args, argv, env)
    # Before the dataset's build, which can take minutes and is said in the log meanwhile.
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args, env)
        # Before the dataset's build: a dead daemon's socket files would tell this node's
        # clients meanwhile that their daemon died (and a live one's refuses the start now).
        claim_daemon_sockets(config.socket)
        size = dataset_size_of(config)
    except (ConfigError, ValueError) as error:  # DatasetLoadError is a ValueError
        print(f"odbd: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    from odbd.daemon.app import run_daemon

    return run_daemon(config, size)


def default_epochs_for_max_updates(
    args: argparse.Namespace, argv: Sequence[str], environ: Mapping[str, str]
) -> None:
    """--max-updates without --epochs: the epochs are endless (the job loops over as many as
    it needs); an --epochs the operator gave too is refused by DaemonConfig."""
    if args.max_updates and not _given("--epochs", argv, environ):
        args.epochs = 0


def _given(flag: str, argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether the operator set `flag` (on the command line or in its ODBD_ variable)."""
    variable = "ODBD_" + flag.lstrip("-").replace("-", "_").upper()
    return variable in environ or any(a == flag or a.startswith(flag + "=") for a in argv)


def version() -> str:
    """The installed odbd release (its package metadata), as `odbd_build_info` shows it."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("odbd")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from odbd.metrics.collector import VERSION

        return VERSION


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    if command in ("--version", "-V"):
        print(f"odbd {version()}")
        return 0
    if command == "simulate":
        from odbd.simulate import main as simulate_main

        return simulate_main(argv[1:])
    if command == "demo":
        from odbd.demo.command import main as demo_main

        return demo_main(argv[1:])
    if command == "status":
        from odbd.status import main as status_main

        return status_main(argv[1:])
    if command and not command.startswith("-"):
        suggestion = flags.did_you_mean(command, list(SUBCOMMANDS), quote="'")
        print(
            f"odbd: error: unknown command {command!r}{suggestion} (commands: "
            f"{', '.join(SUBCOMMANDS)}; the daemon itself takes only --flags, see odbd --help)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return run_daemon_command(argv)


if __name__ == "__main__":
    sys.exit(main())
