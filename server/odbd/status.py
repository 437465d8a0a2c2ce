"""`odbd status`: a live view of a running daemon, read over its unix socket.

The socket is --socket, else $ODBD_SOCKET, else the per-user default: the order ODBClient uses,
so `odbd status` in a trainer's environment asks that trainer's daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from odbclient.connect import accepts_connections
from odbclient.errors import UntrustedDaemonError
from odbclient.local_trust import probe_daemon
from odbclient.wire.odbd.v1 import admin_pb2, admin_pb2_grpc
from odbd import flags
from odbd.config import default_socket

SOCKET_ENV = "ODBD_SOCKET"


def parser() -> argparse.ArgumentParser:
    p = flags.OneLineParser(prog="odbd status", description=__doc__)
    p.add_argument(
        "--socket",
        type=flags.socket_path,
        metavar="PATH",
        help=f"the daemon's unix socket (default: ${SOCKET_ENV}, else {default_socket()})",
    )
    p.add_argument(
        "--watch",
        type=flags.seconds(allow_zero=True),
        default=0.0,
        metavar="S",
        help="refresh every S seconds; 0 = print once",
    )
    p.add_argument(
        "--timeout",
        type=flags.seconds(allow_zero=False),
        default=5.0,
        metavar="S",
        help="how long to wait for the daemon's answer",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the reply as one JSON object a line (admin.proto field names)",
    )
    return p


def as_json(reply: admin_pb2.StatusReply) -> str:
    """The reply as one line of JSON: every field, zeros included, proto field names."""
    fields = json_format.MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return json.dumps(_ints(reply, fields), sort_keys=True)


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64}


def _ints(message: Message, fields: dict[str, Any]) -> dict[str, Any]:
    """64-bit integers as JSON numbers, not the proto3 mapping's strings (jq arithmetic
    works on them; every count here is far below 2**53)."""
    for field in message.DESCRIPTOR.fields:
        value = fields.get(field.name)
        if value is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].type in _INT64:
                fields[field.name] = {k: int(v) for k, v in value.items()}
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            children = getattr(message, field.name)
            if isinstance(value, list):
                fields[field.name] = [_ints(m, v) for m, v in zip(children, value, strict=True)]
            else:
                fields[field.name] = _ints(children, value)
        elif field.type in _INT64:
            fields[field.name] = int(value)
    return fields


def resolve_socket(flag: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """(socket path, where it came from): --socket, else $ODBD_SOCKET, else the default."""
    if flag:
        return flag, "--socket"
    from_env = environ.get(SOCKET_ENV, "").strip()
    if from_env:
        return from_env, SOCKET_ENV
    return default_socket(), "the default"


def render(reply: admin_pb2.StatusReply) -> str:
    used = reply.shm_used_bytes / 2**20
    capacity = reply.shm_capacity_bytes / 2**20
    lines = [
        f"job {reply.job_id!r}  node {reply.node_rank}/{reply.num_nodes}  phase "
        f"{reply.phase}{_phase_note(reply)}  up {reply.uptime_s:.0f} s",
        _planned(reply),
        _trained(reply),
        _delivered(reply),
        f"buffered {reply.buffered_samples}  leased {reply.leased_samples}  producers "
        f"{reply.producers}{_waiting(reply.producers_lane_full)}  "
        f"shm {used:.1f}/{capacity:.1f} MiB",
        "rejected "
        + (", ".join(f"{k}={v}" for k, v in reply.rejected_by_reason.items()) or "none"),
        "rank  trainer  queued  delivered  trained at   samples     tokens  padding  overlap",
    ]
    for r in reply.ranks:
        busy = r.compute_s + r.wait_s
        overlap = f"{r.compute_s / busy:.1%}" if busy else "-"
        attached = "yes" if r.attached else "no"
        at = f"{r.trained_epoch}:{r.trained_epoch_steps}" if r.delivered_steps else "-"
        pad = _share(r.delivered_padded_tokens - r.delivered_real_tokens, r.delivered_padded_tokens)
        lines.append(
            f"{r.rank:>4}  {attached:>7}  {r.queued_steps:>6}  {r.delivered_steps:>9}  "
            f"{at:>10}  {r.delivered_samples:>8}  {r.delivered_loss_tokens:>9}  {pad:>7}  "
            f"{overlap:>7}"
        )
    if reply.HasField("cost_model"):
        lines.append(_cost_model(reply.cost_model))
    if reply.migrate:
        lines.append(
            f"moved    out {reply.migrated_out_samples} samples "
            f"({reply.migrated_out_bytes / 2**20:.1f} MiB)  in {reply.migrated_in_samples} "
            f"samples ({reply.migrated_in_bytes / 2**20:.1f} MiB)  (--migrate auto)"
        )
        lines.append(
            f"rounds   {reply.migration_rounds_dealt} dealt, "
            f"{reply.migration_rounds_balanced} balanced, {reply.migration_rounds_none} moved "
            "nothing (the hub's moves decisions)"
        )
    if reply.ending:
        lines.append(f"ending   {reply.ending}")
    if reply.waiting_for:
        lines.append(f"next round waits because {reply.waiting_for}")
    if reply.last_error:
        lines.append(f"last error: {reply.last_error}")
    return "\n".join(lines)


def _phase_note(reply: admin_pb2.StatusReply) -> str:
    """Draining: planning ended, not training (the issue: 'draining' read as 'almost done')."""
    queued = sum(r.queued_steps for r in reply.ranks)
    if reply.ending:  # steps queued past the end point are dropped, not taken
        return " (ending: see the ending line)"
    if reply.phase == "draining" and queued:
        return f" (every step planned; trainers still to take {queued})"
    return ""


def _planned(reply: admin_pb2.StatusReply) -> str:
    """The planner's position: ahead of training by up to --steps-ahead steps."""
    emitted = reply.epoch_emitted_samples
    steps = _of(reply.planned_epoch_steps_so_far, reply.planned_epoch_steps,
                reply.planned_epoch_steps_exact)  # fmt: skip
    return (
        f"planned  epoch {reply.planned_epoch} step {steps}  steps {reply.planned_steps}  "
        f"rounds {reply.round}  quota {emitted}/{reply.dataset_size} "
        f"({emitted / max(reply.dataset_size, 1):.1%})"
    )


def _trained(reply: admin_pb2.StatusReply) -> str:
    """The trainers' position (the slowest local rank) and the node's delivery rate."""
    if not any(r.delivered_steps for r in reply.ranks):
        return "trained  nothing yet (no step delivered)"
    total = reply.trained_epoch_planned_steps
    steps = _of(reply.trained_epoch_steps, total, total > 0)
    return (
        f"trained  epoch {reply.trained_epoch} step {steps}  samples "
        f"{reply.trained_epoch_samples} (every rank)  epochs done {reply.epochs_trained}  "
        f"node {reply.trained_samples_per_s:.1f} samples/s  {reply.trained_tokens_per_s:.0f} "
        f"tokens/s (last {reply.rate_window_s:g} s)"
    )


def _delivered(reply: admin_pb2.StatusReply) -> str:
    """Padding and overlap of what this node's trainers took."""
    real = sum(r.delivered_real_tokens for r in reply.ranks)
    padded = sum(r.delivered_padded_tokens for r in reply.ranks)
    compute = sum(r.compute_s for r in reply.ranks)
    busy = compute + sum(r.wait_s for r in reply.ranks)
    return (
        f"delivered  padding {_share(padded - real, padded)}  overlap {_share(compute, busy)}  "
        f"queued {sum(r.queued_steps for r in reply.ranks)} steps"
    )


def _of(so_far: int, total: int, exact: bool) -> str:
    if not total:
        return f"{so_far}"
    return f"{so_far} of {total}" if exact else f"{so_far} of ~{total}"


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole > 0 else "-"


def _cost_model(m: admin_pb2.CostModelStatus) -> str:
    """One line: what the planner uses, and the fit behind it."""
    used = "learned" if m.learned else "fixed"
    line = (
        f"cost model {m.mode}: {used} a={m.a:.3g} b={m.b:.3g} c={m.c:.4g} (token-equivalents); "
        f"fit {m.state} over {m.observations} rank-steps"
    )
    if m.state == "fitted":
        line += (
            f": {m.a_seconds:.3g} s/token, {m.b_seconds:.3g} s/token², "
            f"{m.c_seconds * 1e3:.3g} ms/step, error {m.fit_error:.1%} "
            f"(fixed model {m.fixed_error:.1%})"
        )
    return line


def _waiting(lane_full: int) -> str:
    return f" ({lane_full} waiting for lane space)" if lane_full else ""


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    socket, source = resolve_socket(args.socket, os.environ if environ is None else environ)
    try:
        flags.socket_path(socket)
    except argparse.ArgumentTypeError as error:
        p.error(f"{source}: {error}")
    try:  # gRPC shows no peer credentials: check the listener's uid before it gets a byte
        probe_daemon(socket, who="odbd status")
    except UntrustedDaemonError as error:
        print(f"odbd status: error: {error}", file=sys.stderr)
        return 1
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        while True:
            try:
                reply = stub.Status(admin_pb2.StatusRequest(), timeout=args.timeout)
            except grpc.RpcError as error:
                timed_out = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if timed_out and accepts_connections(socket):
                    # Found with a SIGSTOPped daemon: "is odbd running there?" sent the
                    # operator looking for a daemon that was there but frozen.
                    print(
                        f"odbd status: error: the daemon on {socket} (from {source}) accepts "
                        f"connections but did not answer within {args.timeout:g} s: it is "
                        "stopped (SIGSTOP, a debugger), hung or overloaded; check its log and "
                        "`ps -o stat,pid,args` (stat T: stopped), or raise --timeout",
                        file=sys.stderr,
                    )
                    return 1
                print(
                    f"odbd status: error: no daemon answered on {socket} (from {source}): "
                    f"{error.code().name}; is odbd running there? pass --socket or set "
                    f"{SOCKET_ENV} to the daemon's socket (a daemon still building its "
                    "--dataset opens it only after the build: its log says so)",
                    file=sys.stderr,
                )
                return 1
            print(as_json(reply) if args.json else render(reply), flush=True)
            if args.watch <= 0:
                return 0
            time.sleep(args.watch)
            print()
