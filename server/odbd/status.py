"""`odbd status`: a live view of a running daemon, read over its unix socket."""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from odbclient.wire.odbd.v1 import admin_pb2, admin_pb2_grpc
from odbd.config import default_socket


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="odbd status", description=__doc__)
    p.add_argument("--socket", default=default_socket(), help="the daemon's unix socket")
    p.add_argument("--watch", type=float, default=0.0, metavar="S", help="refresh every S s")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S")
    return p


def render(reply: admin_pb2.StatusReply) -> str:
    used = reply.shm_used_bytes / 2**20
    capacity = reply.shm_capacity_bytes / 2**20
    emitted = reply.epoch_emitted_samples
    lines = [
        f"job {reply.job_id!r}  node {reply.node_rank}/{reply.num_nodes}  phase {reply.phase}  "
        f"up {reply.uptime_s:.0f} s",
        f"epoch {reply.epoch}  rounds {reply.round}  quota {emitted}/{reply.dataset_size} "
        f"({emitted / max(reply.dataset_size, 1):.1%})",
        f"buffered {reply.buffered_samples}  leased {reply.leased_samples}  producers "
        f"{reply.producers}{_waiting(reply.producers_lane_full)}  "
        f"shm {used:.1f}/{capacity:.1f} MiB",
        "rejected "
        + (", ".join(f"{k}={v}" for k, v in reply.rejected_by_reason.items()) or "none"),
        "rank  trainer  queued  delivered  overlap",
    ]
    for r in reply.ranks:
        busy = r.compute_s + r.wait_s
        overlap = f"{r.compute_s / busy:.1%}" if busy else "-"
        attached = "yes" if r.attached else "no"
        lines.append(
            f"{r.rank:>4}  {attached:>7}  {r.queued_steps:>6}  {r.delivered_steps:>9}  {overlap:>7}"
        )
    if reply.last_error:
        lines.append(f"last error: {reply.last_error}")
    return "\n".join(lines)


def _waiting(lane_full: int) -> str:
    return f" ({lane_full} waiting for lane space)" if lane_full else ""


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with grpc.insecure_channel(f"unix:{args.socket}") as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        while True:
            try:
                reply = stub.Status(admin_pb2.StatusRequest(), timeout=args.timeout)
            except grpc.RpcError as error:
                print(
                    f"odbd status: error: no daemon answered on {args.socket} "
                    f"({error.code().name}); is odbd running? pass --socket",
                    file=sys.stderr,
                )
                return 1
            print(render(reply), flush=True)
            if args.watch <= 0:
                return 0
            time.sleep(args.watch)
            print()
