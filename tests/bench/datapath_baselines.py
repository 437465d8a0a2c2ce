"""Latency baselines for `next()`: a ready queue.Queue item, and one gRPC aio unary round trip.

`queue_get_latencies`: this process puts an object in a queue.Queue, "computes" (sleeps) like
the benchmark trainer, then times `get()`: the floor of handing over a ready batch.
`grpc_round_trips`: a child process serves grpc.health.v1 on a grpc.aio server over a unix
socket (uvloop, as the daemon runs); this process times `Check` calls from a grpc.aio channel,
back to back: what polling the daemon for every batch would cost. 2 processes run.
The server child runs this file as a script (`python datapath_baselines.py serve SOCKET`).
"""

from __future__ import annotations

import asyncio
import queue
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def queue_get_latencies(num_gets: int, compute_ms: tuple[float, float]) -> list[float]:
    rng = random.Random(0)
    ready: queue.Queue[object] = queue.Queue()
    latencies = []
    for _ in range(num_gets):
        ready.put(object())
        time.sleep(rng.uniform(*compute_ms) / 1e3)
        started = time.perf_counter()
        ready.get()
        latencies.append(time.perf_counter() - started)
    return latencies


def grpc_round_trips(num_calls: int, warmup: int = 200) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="odbd-bench-grpc-") as tmp:
        path = str(Path(tmp) / "health.sock")
        server = subprocess.Popen(
            [sys.executable, __file__, "serve", path], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("the gRPC baseline server failed to start")
            return asyncio.run(_time_checks(path, num_calls, warmup))
        finally:
            server.terminate()
            server.wait(timeout=10)
            assert server.stdout is not None
            server.stdout.close()


async def _time_checks(path: str, num_calls: int, warmup: int) -> list[float]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        latencies = []
        for k in range(warmup + num_calls):
            started = time.perf_counter()
            await stub.Check(request)
            if k >= warmup:
                latencies.append(time.perf_counter() - started)
        return latencies


async def _serve(path: str) -> None:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    import uvloop

    uvloop.run(_serve(sys.argv[2]))
