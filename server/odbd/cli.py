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

from odbd import flag_files, flags
from odbd.config import (
    DEFAULT_PADS,
    DaemonConfig,
    default_socket,
    node_rank_from_environment,
)
from odbd.daemon.socket_claim import claim_daemon_sockets
from odbd.daemon_flags import SUBCOMMANDS, daemon_parser
from odbd.dataset_size import dataset_size_of
from odbd.errors import ConfigError
from odbd.planner.config import Align, Attention, Balance, Collate, Grouping, LossScaling
from odbd.planner.cost_fit import CostModelMode
from odbd.world import World

EXIT_USAGE = flags.EXIT_USAGE


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
