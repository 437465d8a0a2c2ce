"""`odbd`: the node daemon, plus `odbd simulate | demo | status`.

Every daemon flag also reads from ODBD_<FLAG> (e.g. ODBD_WORLD=16, ODBD_NO_JOIN=1 is written
ODBD_JOIN=false); a flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from odbd.config import DaemonConfig, default_socket, node_rank_from_environment
from odbd.errors import ConfigError
from odbd.planner.config import Balance, Grouping, LossScaling
from odbd.round.config import PeerTls
from odbd.world import World

EXIT_USAGE = 2
SUBCOMMANDS = ("simulate", "demo", "status")


class _OneLineParser(argparse.ArgumentParser):
    """Operator errors are one line and exit status 2, never a usage dump or a traceback."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _size(text: str) -> int:
    """Bytes with an optional K/M/G suffix (powers of two)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("b").removesuffix("i")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def daemon_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="odbd", description="online dynamic batching daemon (one per node)")
    add = p.add_argument
    add("--world", type=int, required=True, metavar="W", help="trainer DDP world size")
    add("--nproc-per-node", type=int, required=True, metavar="G", help="trainer ranks per node")
    add("--node-rank", type=int, metavar="n", help="default: NODE_RANK/GROUP_RANK or pod index")
    add("--peers", default="", metavar="H:P,...", help="peer daemons in node-rank order")
    add("--listen", default="127.0.0.1:0", metavar="HOST:PORT", help="peer gRPC listener")
    add("--socket", default=default_socket(), metavar="PATH", help="unix socket (mode 0600)")
    add("--metrics-port", type=int, metavar="P", help="serve Prometheus /metrics on this port")
    add("--metrics-host", default="127.0.0.1", metavar="HOST", help="address /metrics binds")
    add("--health-listen", default="", metavar="HOST:PORT", help="grpc.health.v1 over TCP")
    add("--drain-timeout", type=float, default=30.0, metavar="S", help="SIGTERM grace period")
    add(
        "--attach-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="a local rank not attached this long (from start-up or its detach) fails the job; "
        "generous because loading a model can take many minutes. The job ends only once "
        "every local rank took its end (no fixed grace)",
    )
    add("--dataset", metavar="MODULE:FACTORY", help="spawn producers importing this dataset")
    add("--dataset-arg", type=_key_value, action="append", default=[], metavar="KEY=VALUE")
    add("--workers", type=int, default=2, metavar="K", help="producer processes to spawn")
    add("--dataset-size", type=int, metavar="N", help="external producers; dataset length")
    add("--token-budget", type=int, default=12288, metavar="L", help="padded tokens per group")
    add("--buffer", type=int, default=1024, metavar="B", help="samples buffered per rank")
    add("--seed", type=int, default=0)
    add("--epochs", type=int, default=1, metavar="E", help="0 = endless")
    add("--join", action=argparse.BooleanOptionalAction, default=True, help="termination mode")
    add("--shuffle", action=argparse.BooleanOptionalAction, default=True)
    add("--loss-scaling", choices=[m.value for m in LossScaling], default="exact")
    add("--grouping", choices=[g.value for g in Grouping], default="min-time")
    add("--balance", choices=[b.value for b in Balance], default="node")
    add("--length-key", default="input_ids")
    add("--labels-key", default="labels", help="key whose -100 entries carry no loss")
    add("--pad", type=_key_value, action="append", default=[], metavar="KEY=VALUE")
    add("--state-dir", type=Path, metavar="DIR")
    add("--job-id", default="odbd")
    add("--job-token-file", type=Path, metavar="FILE", help="shared secret of the job's daemons")
    add("--tls-cert", type=Path, metavar="PEM", help="peer mTLS: this daemon's certificate")
    add("--tls-key", type=Path, metavar="PEM", help="peer mTLS: its private key")
    add("--tls-ca", type=Path, metavar="PEM", help="peer mTLS: CA that signs every daemon")
    add("--shm-size", type=_size, default=1 << 30, metavar="BYTES", help="e.g. 512M, 4G")
    add("--lease-timeout", type=float, default=60.0, metavar="S")
    add("--round-timeout", type=float, default=300.0, metavar="S")
    add("--join-timeout", type=float, default=120.0, metavar="S")
    add("--steps-ahead", type=int, default=64, metavar="K", help="queued steps per rank")
    add("--log-level", default="INFO")
    return p


def apply_environment(parser: argparse.ArgumentParser, environ: dict[str, str]) -> None:
    """ODBD_<FLAG> values become defaults, so the command line still wins."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = "ODBD_" + action.dest.upper()
        if name not in environ:
            continue
        raw = environ[name]
        if isinstance(action, argparse.BooleanOptionalAction):
            value: object = raw.strip().lower() in ("1", "true", "yes", "on")
        elif action.type is not None:
            try:
                value = action.type(raw)  # type: ignore[operator]
            except (ValueError, argparse.ArgumentTypeError) as error:
                raise ConfigError(f"{name}={raw!r} is not valid: {error}") from None
        else:
            value = raw
        if isinstance(action, argparse._AppendAction):
            value = [value]
        action.default = value
        action.required = False


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    token = b""
    if args.job_token_file is not None:
        try:
            token = args.job_token_file.read_bytes().strip()
        except OSError as error:
            raise ConfigError(f"cannot read --job-token-file: {error}") from None
    pads = {"labels": -100.0}
    for key, value in args.pad:
        try:
            pads[key] = float(value)
        except ValueError:
            raise ConfigError(f"--pad {key}={value}: the value must be a number") from None
    return DaemonConfig(
        world=World(args.world, args.nproc_per_node),
        node_rank=args.node_rank if args.node_rank is not None else node_rank_from_environment(),
        peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()),
        listen=args.listen,
        socket=args.socket,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        health_listen=args.health_listen,
        drain_timeout_s=args.drain_timeout,
        attach_timeout_s=args.attach_timeout,
        dataset=args.dataset,
        dataset_args=tuple(args.dataset_arg),
        workers=args.workers,
        dataset_size=args.dataset_size,
        token_budget=args.token_budget,
        buffer=args.buffer,
        seed=args.seed,
        epochs=args.epochs,
        join=args.join,
        shuffle=args.shuffle,
        loss_scaling=LossScaling(args.loss_scaling),
        grouping=Grouping(args.grouping),
        balance=Balance(args.balance),
        length_key=args.length_key,
        labels_key=args.labels_key,
        pads=tuple(pads.items()),
        state_dir=args.state_dir,
        job_id=args.job_id,
        job_token=token,
        peer_tls=_peer_tls(args),
        shm_size=args.shm_size,
        lease_timeout_s=args.lease_timeout,
        round_timeout_s=args.round_timeout,
        join_timeout_s=args.join_timeout,
        steps_ahead=args.steps_ahead,
    )


def _peer_tls(args: argparse.Namespace) -> PeerTls | None:
    """The three --tls-* files (all or none), read once: the daemon never rereads them."""
    files = {"--tls-cert": args.tls_cert, "--tls-key": args.tls_key, "--tls-ca": args.tls_ca}
    given = [flag for flag, path in files.items() if path is not None]
    if not given:
        return None
    if len(given) != len(files):
        missing = sorted(set(files) - set(given))
        raise ConfigError(
            f"peer mTLS needs --tls-cert, --tls-key and --tls-ca together; missing {missing}"
        )
    data = {}
    for flag, path in files.items():
        try:
            data[flag] = path.read_bytes()
        except OSError as error:
            raise ConfigError(f"cannot read {flag}: {error}") from None
    return PeerTls(
        cert_chain=data["--tls-cert"],
        private_key=data["--tls-key"],
        root_certificates=data["--tls-ca"],
    )


def dataset_size_of(config: DaemonConfig) -> int:
    """--dataset-size, or len() of the dataset the producers will import."""
    if config.dataset_size is not None:
        return config.dataset_size
    from odbclient.dataset import load_dataset, parse_dataset_args

    assert config.dataset is not None
    args = parse_dataset_args([f"{k}={v}" for k, v in config.dataset_args])
    return len(load_dataset(config.dataset, args))


def run_daemon_command(argv: Sequence[str]) -> int:
    parser = daemon_parser()
    try:
        apply_environment(parser, dict(os.environ))
        args = parser.parse_args(list(argv))
        logging.basicConfig(
            level=args.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        config = config_from_args(args)
        size = dataset_size_of(config)
    except (ConfigError, ValueError) as error:
        print(f"odbd: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    from odbd.daemon.app import run_daemon

    return run_daemon(config, size)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "simulate":
        from odbd.simulate import main as simulate_main

        return simulate_main(argv[1:])
    if argv and argv[0] == "demo":
        from odbd.demo.command import main as demo_main

        return demo_main(argv[1:])
    if argv and argv[0] == "status":
        from odbd.status import main as status_main

        return status_main(argv[1:])
    return run_daemon_command(argv)


if __name__ == "__main__":
    sys.exit(main())
