"""The interactive round trip: ``float(f(x))`` of a cached tiny program, local JAX vs the proxy vs a cluster.

    python benchmarks/round_trip.py [--before CHECKOUT] [--rounds N]

A notebook user pays this on every printed value. Each path runs in a client
process of its own (local JAX; ``pathways-nb proxy`` with one device; a
``LocalCluster`` of one island of one device), and the processes take turns,
a burst of calls each, so that the load of a shared machine falls on all of
them alike. Bare gRPC round trips on this machine (a grpc.aio echo server, as
ours are, and a Python client) give the bound: the stock client waits for two
round trips per read (``copy_to_host_buffer`` on the session stream, then the
``HostBufferLookup`` stream), and its other requests of the call
(``loaded_executable_execute``, ``fully_replicated_shard``, the batched
``destruct_array``) are pipelined.

``--before CHECKOUT`` also runs the servers (proxy, resource manager, workers)
from another checkout of pathways-nb, e.g. ``git worktree add --detach
/tmp/rt-before main``, side by side in the same run. Columns: wall time per
call (percentiles), and CPU time per call of the servers (proxy and worker)
and of the client, which load on the machine changes much less.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys

import psutil

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.launch.processes import ChildServer
from pathways_nb.testing import python_process

FLOAT_OF_F = """
    import sys, time, jax, numpy as np, pathways_nb
    address, token = sys.argv[1:3]
    if address == "local":
        device = jax.devices("cpu")[0]
    else:
        pathways_nb.connect(address, token=token or None)
        device = jax.devices()[0]
    f = jax.jit(lambda a: a * 2 + 1)
    x = jax.device_put(np.float32(3), device)
    for _ in range(50):
        assert float(f(x)) == 7.0
    print("ready", flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            started = time.perf_counter()
            float(f(x))
            times.append(time.perf_counter() - started)
        print(" ".join(f"{t * 1e6:.1f}" for t in times), flush=True)
"""

BARE_GRPC = """
    import sys, time, queue, grpc
    channel = grpc.insecure_channel(sys.argv[1])
    unary, server_stream = channel.unary_unary("/echo.Echo/Unary"), channel.unary_stream("/echo.Echo/ServerStream")
    requests = queue.SimpleQueue()
    replies = channel.stream_stream("/echo.Echo/Bidi")(iter(requests.get, None))
    def bidi(message):
        requests.put(message)
        return next(replies)
    call = {"unary": unary, "server-streaming": lambda m: list(server_stream(m)), "bidi message": bidi}[sys.argv[2]]
    for _ in range(50):
        call(b"x" * 16)
    print("ready", flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            started = time.perf_counter()
            call(b"x" * 16)
            times.append(time.perf_counter() - started)
        print(" ".join(f"{t * 1e6:.1f}" for t in times), flush=True)
"""


def serve_echo() -> None:
    """A grpc.aio echo server (unary, server-streaming, bidi) with our servers' options; prints its port."""
    import grpc

    from pathways_nb.core.aio_server import SERVER_OPTIONS

    async def unary(request, context):
        return request

    async def server_stream(request, context):
        yield request

    async def bidi(request_iterator, context):
        async for request in request_iterator:
            yield request

    async def main() -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "echo.Echo",
                    {
                        "Unary": grpc.unary_unary_rpc_method_handler(unary),
                        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
                        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
                    },
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


class Client:
    """A client process that times ``burst`` calls when asked; its servers' pids are watched for CPU."""

    def __init__(self, name: str, code: str, args: list[str], servers: list[int]):
        self.name = name
        self.process = python_process(code, *args)
        self.servers = [psutil.Process(pid) for pid in servers]
        self.samples: list[float] = []
        self.server_cpu_ms: list[float] = []  # per call, one entry per burst
        self.client_cpu_ms: list[float] = []

    def wait_ready(self) -> None:
        line = self.process.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"{self.name} did not start: {line}\n{self.process.stderr.read()[-3000:]}")

    def burst(self, calls: int) -> None:
        client = psutil.Process(self.process.pid)
        server_before = sum(sum(p.cpu_times()[:2]) for p in self.servers)
        client_before = sum(client.cpu_times()[:2])
        self.process.stdin.write(f"{calls}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} ended: {self.process.stderr.read()[-3000:]}")
        self.samples.extend(float(t) for t in line.split())
        server = sum(sum(p.cpu_times()[:2]) for p in self.servers) - server_before
        self.server_cpu_ms.append(server * 1000 / calls)
        self.client_cpu_ms.append((sum(client.cpu_times()[:2]) - client_before) * 1000 / calls)

    def row(self) -> tuple:
        samples = sorted(self.samples)

        def at(q: float) -> float:
            return samples[min(len(samples) - 1, int(q * len(samples)))] / 1000

        server = f"{statistics.mean(self.server_cpu_ms):.2f}" if self.servers else "-"
        return self.name, at(0.1), at(0.5), at(0.9), server, f"{statistics.mean(self.client_cpu_ms):.2f}"

    def close(self) -> None:
        self.process.kill()
        self.process.communicate()


@contextlib.contextmanager
def servers_from(checkout: str | None):
    """Child servers started inside the block import pathways_nb from ``checkout`` (None: this one)."""
    if checkout is None:
        yield None
        return
    saved_path, saved_cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    # ``python -m`` puts the working directory first on the path, so the children start there.
    os.environ["PYTHONPATH"] = checkout
    os.chdir(checkout)
    try:
        yield {**os.environ}
    finally:
        os.chdir(saved_cwd)
        if saved_path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved_path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=None, help="a checkout whose servers run beside this one's")
    parser.add_argument("--rounds", type=int, default=20, help="bursts per path")
    parser.add_argument("--burst", type=int, default=50, help="calls per burst")
    parser.add_argument("--serve-echo", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_echo:
        serve_echo()
        return 0

    echo = subprocess.Popen([sys.executable, __file__, "--serve-echo"], stdout=subprocess.PIPE, text=True)
    started: list = []
    clients: list[Client] = []
    try:
        echo_address = f"127.0.0.1:{int(echo.stdout.readline())}"
        clients.append(Client("local JAX", FLOAT_OF_F, ["local", ""], []))
        for kind in ("bidi message", "server-streaming", "unary"):
            clients.append(Client(f"bare gRPC: {kind}", BARE_GRPC, [echo_address, kind], [echo.pid]))
        versions = [("before", args.before), ("after", None)] if args.before else [("", None)]
        for label, checkout in versions:
            suffix = f" ({label})" if label else ""
            with servers_from(checkout) as env:
                proxy = ChildServer("proxy", ["proxy", "--server_port", "0", "--devices", "1"], env=env)
                started.append(proxy)
                proxy.start()
                cluster = LocalCluster(islands=1, devices_per_host=1)
                started.append(cluster)
            clients.append(Client(f"proxy{suffix}", FLOAT_OF_F, [proxy.address, ""], [proxy.process.pid]))
            cluster_pids = [cluster.proxy.process.pid, *(w.process.pid for w in cluster.workers.values())]
            clients.append(Client(f"cluster{suffix}", FLOAT_OF_F, [cluster.address, cluster.token], cluster_pids))
        for client in clients:
            client.wait_ready()
        for _ in range(args.rounds):
            for client in clients:
                client.burst(args.burst)
    finally:
        for client in clients:
            client.close()
        for server in reversed(started):
            server.close()
        echo.kill()
        echo.wait()
    print(f"float(f(x)) of a cached tiny jit, {args.rounds} x {args.burst} calls per path, interleaved\n")
    print(f"{'path':<28} {'p10 ms':>7} {'p50 ms':>7} {'p90 ms':>7} {'server CPU ms':>14} {'client CPU ms':>14}")
    for name, p10, p50, p90, server_cpu, client_cpu in (client.row() for client in clients):
        print(f"{name:<28} {p10:>7.3f} {p50:>7.3f} {p90:>7.3f} {server_cpu:>14} {client_cpu:>14}")
    print("\n(CPU ms per call over all bursts; cluster: proxy and worker together; bare gRPC: the echo server)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
