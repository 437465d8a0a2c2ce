"""The daemon's flags, one function per flag group (cli.py parses them and reads ODBD_<FLAG>).

The flags that shape the plan itself (PLANNER_FLAGS) are defined once here and taken by
`odbd simulate` too, so an offline simulation reads them exactly as a daemon would. A new flag
goes into its group's function, in the order `odbd --help` and server/README.md list it.
"""

from __future__ import annotations

import argparse
from enum import StrEnum
from pathlib import Path
from typing import Any

from odbd import flags
from odbd.config import DEFAULT_ROUND_FANOUT, default_socket
from odbd.planner.config import Align, Attention, Balance, Collate, Grouping, LossScaling
from odbd.planner.cost_fit import CostModelMode
from odbd.planner.migration import DEFAULT_LINK_BYTES_PER_S

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


def choices(enum: type[StrEnum]) -> str:
    """An enum's values as a metavar, e.g. {steps,updates}."""
    return "{" + ",".join(member.value for member in enum) + "}"


count, seconds = flags.integer, flags.seconds
# The planner-shaping flags of both the daemon and `odbd simulate`: name -> add_argument kwargs.
PLANNER_FLAGS: dict[str, dict[str, Any]] = {
    "--token-budget": dict(
        type=flags.any_integer,
        default=12288,
        metavar="L",
        help="padded tokens per group",
    ),
    "--buffer": dict(
        type=flags.any_integer,
        default=1024,
        metavar="B",
        help="samples buffered per rank",
    ),
    "--seed": dict(
        type=count(0, flags.MAX_SEED),
        default=0,
        metavar="S",
        help="sampler seed (as DistributedSampler)",
    ),
    "--join": dict(
        action=argparse.BooleanOptionalAction,
        default=True,
        help="join: every identity each epoch; no-join: sample quota",
    ),
    "--loss-scaling": dict(
        type=flags.choice_of([m.value for m in LossScaling]),
        default="exact",
        metavar=choices(LossScaling),
        help="how per-rank losses are scaled",
    ),
    "--grouping": dict(
        type=flags.choice_of([g.value for g in Grouping]),
        default="min-time",
        metavar=choices(Grouping),
        help="how samples are grouped into steps",
    ),
    "--balance": dict(
        type=flags.choice_of([b.value for b in Balance]),
        default="node",
        metavar=choices(Balance),
        help="pool a node's buffers or keep per-rank buffers",
    ),
    "--migrate": dict(
        type=flags.choice_of(["auto", "off"]),
        default="off",
        metavar="{auto,off}",
        help="auto: move samples between nodes when the link model says it lowers the round's "
        "time (issue 26; docs/bench/migration.md; a --state-dir restart stays exact); off "
        "(default until make test and make soak pass with auto as the default): every sample "
        "trains on the node whose producers made it",
    ),
    "--link-gbps": dict(
        type=flags.number,
        default=DEFAULT_LINK_BYTES_PER_S * 8 / 1e9,
        metavar="GBPS",
        help="--migrate auto: each node's bulk bandwidth per direction, Gb/s (default 8: one "
        "loopback gRPC stream measured 9.0 Gb/s on the reference machine)",
    ),
    "--accumulate": dict(
        type=count(1),
        default=1,
        metavar="K",
        help="K micro-steps per optimizer update on every rank (batch.update_end marks the last)",
    ),
    "--tokens-per-update": dict(
        type=count(0),
        default=0,
        metavar="T",
        help="close an update once its micro-steps hold >= T loss-bearing tokens over all ranks "
        "(0 = off; excludes --accumulate)",
    ),
    "--align": dict(
        type=flags.choice_of([a.value for a in Align]),
        default="steps",
        metavar=choices(Align),
        help="where ranks wait for each other: every micro-step (steps), or once per optimizer "
        "update, each rank running its own micro-steps (updates; needs --accumulate or "
        "--tokens-per-update, and DDP or ZeRO-1/2, not FSDP: docs/training.md)",
    ),
    "--collate": dict(
        type=flags.choice_of([c.value for c in Collate]),
        default="padded",
        metavar=choices(Collate),
        help="padded: rows padded per --pad, area longest x count <= L; packed: one padding-free "
        "row per rank-step with position_ids and cu_seq_lens (Hugging Face padding-free), "
        "sum of lengths <= L",
    ),
    "--max-patches": dict(
        type=count(0),
        default=0,
        metavar="N",
        help="at most N vision patches per group beside the token budget (0 = off; needs "
        "--patch-key, --patch-count-key or a --concat key)",
    ),
}


def add_planner_flag(group: argparse._ArgumentGroup, name: str, **overrides: Any) -> None:
    """Adds the shared planner flag `name`; `overrides` replace its add_argument kwargs."""
    group.add_argument(name, **{**PLANNER_FLAGS[name], **overrides})


def daemon_parser() -> flags.OneLineParser:
    """The daemon's flags; each value is checked by its type function at parse time."""
    p = flags.OneLineParser(
        prog="odbd",
        usage=USAGE,
        description="online dynamic batching daemon (one per node)",
        epilog=EPILOG,
    )
    add_world_flags(p.add_argument_group("world and data"))
    add_batching_flags(p.add_argument_group("batching"))
    add_network_flags(p.add_argument_group("sockets and network"))
    add_safety_flags(p.add_argument_group("timeouts, state and security"))
    return p


def add_world_flags(group: argparse._ArgumentGroup) -> None:
    """The world and the data: ranks, node rank, dataset."""
    group.add_argument(
        "--world", type=count(1), required=True, metavar="W", help="trainer DDP world size"
    )
    group.add_argument(
        "--nproc-per-node", type=count(1), required=True, metavar="G", help="trainer ranks per node"
    )
    group.add_argument(
        "--node-rank",
        type=count(0),
        metavar="N",
        help="this node's index (default: from NODE_RANK, GROUP_RANK, JOB_COMPLETION_INDEX "
        "or the pod name)",
    )
    group.add_argument(
        "--dataset", metavar="MODULE:FACTORY", help="spawn producers importing this dataset"
    )
    group.add_argument(
        "--dataset-arg",
        type=flags.key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="argument of the dataset factory (repeatable)",
    )
    group.add_argument(
        "--workers",
        type=count(0),
        default=2,
        metavar="K",
        help="producer processes to spawn with --dataset",
    )
    group.add_argument(
        "--dataset-size",
        type=count(1, flags.MAX_DATASET_SIZE),
        metavar="N",
        help="dataset length, with external producers (instead of --dataset)",
    )


def add_batching_flags(group: argparse._ArgumentGroup) -> None:
    """How samples become steps (the shared planner flags among them)."""
    # --token-budget and --buffer: PlannerConfig checks them (> 0) with messages naming the flag.
    add_planner_flag(group, "--token-budget")
    add_planner_flag(group, "--buffer")
    add_planner_flag(group, "--seed")
    group.add_argument("--epochs", type=count(0), default=1, metavar="E", help="0 = endless")
    group.add_argument(
        "--max-updates",
        type=count(0),
        default=0,
        metavar="N",
        help="end the job after exactly N optimizer updates (= steps without --accumulate) on "
        "every rank, looping over epochs, each reshuffled (0 = off; --epochs then defaults to 0)",
    )
    add_planner_flag(group, "--join")
    group.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shuffle like DistributedSampler(shuffle=True)",
    )
    add_planner_flag(group, "--loss-scaling")
    add_planner_flag(group, "--grouping")
    group.add_argument(
        "--cost-model",
        type=flags.choice_of([m.value for m in CostModelMode]),
        default="auto",
        metavar=choices(CostModelMode),
        help="auto: fit the planner's step cost to the step times trainers report "
        "(ODBClient.report_compute) once warmed up, fixed until then; fixed: never",
    )
    group.add_argument(
        "--cost-warmup",
        type=count(3),
        default=64,
        metavar="N",
        help="--cost-model auto: timed rank-steps (over every node) before the first fit; "
        "fewer lets a short job plan with its own costs sooner, on a noisier fit",
    )
    add_planner_flag(group, "--balance")
    add_planner_flag(group, "--migrate")
    add_planner_flag(group, "--link-gbps")
    group.add_argument(
        "--length-key",
        type=flags.nonempty,
        default="input_ids",
        metavar="KEY",
        help="key whose length is the sample's token count",
    )
    group.add_argument(
        "--labels-key",
        type=flags.nonempty,
        default="labels",
        metavar="KEY",
        help="key whose -100 entries carry no loss",
    )
    group.add_argument(
        "--pad",
        type=flags.key_number,
        action="append",
        default=[],
        metavar="KEY=NUMBER",
        help="pad value of a key (labels=-100 is built in; repeatable)",
    )
    group.add_argument(
        "--max-reject-fraction",
        type=flags.fraction,
        default=0.01,
        metavar="F",
        help="fail the job once an epoch rejects more than F of its samples over every node "
        "(counts per reason, first ids and the fix in one line); 0 = any rejection fails, "
        "1 = never",
    )
    group.add_argument(
        "--check-finite",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="producers reject (reason non_finite) a sample whose float keys hold NaN or inf",
    )
    group.add_argument(
        "--steps-ahead",
        type=count(1),
        default=64,
        metavar="K",
        help="plan the next round once a rank has at most K steps queued",
    )
    add_planner_flag(group, "--accumulate")
    add_planner_flag(group, "--tokens-per-update")
    add_planner_flag(group, "--align")
    add_planner_flag(group, "--collate")
    group.add_argument(
        "--attention",
        type=flags.choice_of([a.value for a in Attention]),
        default="auto",
        metavar=choices(Attention),
        help="--collate packed: what a packed row's attention costs. dense: over the whole row "
        "(eager/sdpa, CPU; rows are then cut at the cheapest length per token); varlen: per "
        "sample (flash_attention_2, flex document masks); auto: learned from the step times "
        "trainers report (--cost-model auto), varlen until then",
    )
    group.add_argument(
        "--concat",
        type=flags.key_list,
        action="append",
        default=[],
        metavar="KEY",
        help="join KEY along its first dimension (e.g. pixel_values [patches, dim]) with "
        "KEY_offsets per sample, instead of padding or stacking it (repeatable, or KEY,KEY)",
    )
    add_planner_flag(group, "--max-patches")
    group.add_argument(
        "--patch-key",
        type=flags.nonempty,
        default=None,
        metavar="KEY",
        help="a sample's patch count is KEY's first dimension (default: the first --concat key)",
    )
    group.add_argument(
        "--patch-count-key",
        type=flags.nonempty,
        default=None,
        metavar="KEY",
        help="a sample's patch count is the integer value of KEY (instead of --patch-key)",
    )


def add_network_flags(group: argparse._ArgumentGroup) -> None:
    """Sockets, peers, metrics and health endpoints."""
    group.add_argument(
        "--socket",
        type=flags.socket_path,
        default=default_socket(),
        metavar="PATH",
        help="unix socket of trainers and producers (mode 0600); its directory must exist "
        "(the default's is created mode 0700, and refused if another user owns it or others "
        "can write it)",
    )
    group.add_argument(
        "--peers",
        type=flags.host_port_list,
        default=(),
        metavar="H:P,...",
        help="peer daemons in node-rank order (multi-node)",
    )
    group.add_argument(
        "--listen",
        type=flags.host_port,
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="peer gRPC listener",
    )
    group.add_argument(
        "--metrics-port",
        type=count(0, 65535),
        metavar="P",
        help="serve Prometheus /metrics on this port (0 = any free port)",
    )
    group.add_argument(
        "--metrics-host",
        type=flags.nonempty,
        default="127.0.0.1",
        metavar="HOST",
        help="address /metrics binds",
    )
    group.add_argument(
        "--health-listen",
        type=flags.optional_host_port,
        default="",
        metavar="HOST:PORT",
        help="grpc.health.v1 over TCP; empty = socket only",
    )


def add_safety_flags(group: argparse._ArgumentGroup) -> None:
    """Timeouts, state, security and logging."""
    group.add_argument(
        "--lease-timeout",
        type=seconds(allow_zero=False),
        default=60.0,
        metavar="S",
        help="a producer's lease expires after S without a commit; a --workers process "
        "inside one dataset[i] for S is killed as hung",
    )
    group.add_argument(
        "--round-timeout",
        type=seconds(allow_zero=False),
        default=300.0,
        metavar="S",
        help="a round's contributions arrive within S",
    )
    group.add_argument(
        "--round-fanout",
        type=int,
        default=DEFAULT_ROUND_FANOUT,
        metavar="K",
        help="children per daemon in the relay tree of the round exchanges: node 0 writes to "
        f"at most K daemons, each relaying for at most K more (default {DEFAULT_ROUND_FANOUT}; the "
        "same on every daemon)",
    )
    group.add_argument(
        "--join-timeout",
        type=seconds(allow_zero=False),
        default=120.0,
        metavar="S",
        help="every daemon joins the job within S",
    )
    group.add_argument(
        "--drain-timeout",
        type=seconds(allow_zero=True),
        default=30.0,
        metavar="S",
        help="SIGTERM grace period",
    )
    group.add_argument(
        "--attach-timeout",
        type=seconds(allow_zero=False),
        default=1800.0,
        metavar="S",
        help="a local rank not attached this long (from start-up or its detach) fails the job; "
        "generous because loading a model can take many minutes. The job ends only once "
        "every local rank took its end (no fixed grace)",
    )
    group.add_argument(
        "--end-timeout",
        type=seconds(allow_zero=False),
        default=60.0,
        metavar="S",
        help="once a rank called ODBClient.end_job(), every rank must call it within S, else "
        "the job fails naming the ranks that did not",
    )
    group.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="journal directory for restarts (created if missing)",
    )
    group.add_argument(
        "--rewind-steps",
        type=count(0),
        default=4096,
        metavar="N",
        help="steps per rank the daemon keeps (ids, not samples) so a trainer restarted from an "
        "older checkpoint gets the same steps again on the running daemon; a resume point "
        "older than that is refused by name. About 200 bytes + 28 per sample per rank-step",
    )
    group.add_argument(
        "--job-id",
        type=flags.nonempty,
        default="odbd",
        metavar="ID",
        help="names the job's shm segments; peers must match",
    )
    group.add_argument(
        "--job-token-file",
        type=Path,
        metavar="FILE",
        help="shared secret of the job's daemons (non-empty, e.g. openssl rand -hex 32); "
        "peers prove it by challenge-response, it never crosses the network",
    )
    group.add_argument(
        "--tls-cert", type=Path, metavar="PEM", help="peer mTLS: this daemon's certificate"
    )
    group.add_argument("--tls-key", type=Path, metavar="PEM", help="peer mTLS: its private key")
    group.add_argument(
        "--tls-ca", type=Path, metavar="PEM", help="peer mTLS: CA that signs every daemon"
    )
    group.add_argument(
        "--insecure",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let a multi-node daemon on a non-loopback address run without a job token or "
        "mTLS (only on an isolated network where every host is trusted)",
    )
    group.add_argument(
        "--shm-size",
        type=flags.size_bytes,
        default="1G",
        metavar="BYTES",
        help="shared memory arena, e.g. 512M, 4G",
    )
    group.add_argument(
        "--log-level",
        type=flags.choice_of(LOG_LEVELS, upper=True),
        default="INFO",
        metavar="LEVEL",
        help=", ".join(LOG_LEVELS),
    )
