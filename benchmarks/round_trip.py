"""The interactive round trip: ``float(f(x))`` of a cached tiny program, local JAX vs the proxy vs a cluster.

    python benchmarks/round_trip.py [--before CHECKOUT] [--rounds N] [--chain]

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

``--chain`` measures the control plane's other figure instead: chained tiny programs (``x = f(x)``, a
burst dispatched back to back and waited for once at its end), as programs per second and the CPU
each program costs the proxy and the cluster's worker, apart.
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

# A client of local JAX, or of the server at argv[1] (with the token argv[2]): its first device.
ON_ITS_DEVICE = """
    import sys, time, jax, numpy as np, pathways_nb
    address, token = sys.argv[1:3]
    if address == "local":
        device = jax.devices("cpu")[0]
    else:
        pathways_nb.connect(address, token=token or None)
        device = jax.devices()[0]
"""

FLOAT_OF_F = (
    ON_ITS_DEVICE
    + """
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
)

CHAIN_OF_F = (
    ON_ITS_DEVICE
    + """
    f = jax.jit(lambda a: a * 0.5 + 1)
    x = jax.device_put(np.float32(3), device)
    for _ in range(200):
        x = f(x)
    x.block_until_ready()
    print("ready", flush=True)
    for line in sys.stdin:
        calls = int(line)
        started = time.perf_counter()
        for _ in range(calls):
            x = f(x)
        x.block_until_ready()
        per_call = (time.perf_counter() - started) / calls
        print(" ".join([f"{per_call * 1e6:.1f}"] * calls), flush=True)
"""
)

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
    """A client process that times ``burst`` calls when asked; its servers' pids are watched for CPU.

    ``servers`` maps a role (``proxy``, ``worker``) to the pids whose CPU that role's column sums."""

    def __init__(self, name: str, code: str, args: list[str], servers: dict[str, list[int]]):
        self.name = name
        self.process = python_process(code, *args)
        self.servers = {role: [psutil.Process(pid) for pid in pids] for role, pids in servers.items()}
        self.samples: list[float] = []
        self.server_cpu_ms: dict[str, list[float]] = {role: [] for role in servers}  # per call, one per burst
        self.client_cpu_ms: list[float] = []

    def wait_ready(self) -> None:
        line = self.process.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"{self.name} did not start: {line}\n{self.process.stderr.read()[-3000:]}")

    def _server_cpu(self) -> dict[str, float]:
        return {role: sum(sum(p.cpu_times()[:2]) for p in processes) for role, processes in self.servers.items()}

    def burst(self, calls: int) -> None:
        client = psutil.Process(self.process.pid)
        server_before = self._server_cpu()
        client_before = sum(client.cpu_times()[:2])
        self.process.stdin.write(f"{calls}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} ended: {self.process.stderr.read()[-3000:]}")
        self.samples.extend(float(t) for t in line.split())
        for role, seconds in self._server_cpu().items():
            self.server_cpu_ms[role].append((seconds - server_before[role]) * 1000 / calls)
        self.client_cpu_ms.append((sum(client.cpu_times()[:2]) - client_before) * 1000 / calls)

    def row(self) -> tuple:
        samples = sorted(self.samples)

        def at(q: float) -> float:
            return samples[min(len(samples) - 1, int(q * len(samples)))] / 1000

        def cpu(role: str) -> str:
            return f"{statistics.mean(self.server_cpu_ms[role]):.3f}" if role in self.servers else "-"

        client_cpu = f"{statistics.mean(self.client_cpu_ms):.3f}"
        return self.name, at(0.1), at(0.5), at(0.9), cpu("proxy"), cpu("worker"), cpu("echo"), client_cpu

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
    parser.add_argument("--chain", action="store_true", help="chained tiny programs instead of float(f(x))")
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
        workload = CHAIN_OF_F if args.chain else FLOAT_OF_F
        clients.append(Client("local JAX", workload, ["local", ""], {}))
        for kind in ("bidi message", "server-streaming", "unary") if not args.chain else ():
            clients.append(Client(f"bare gRPC: {kind}", BARE_GRPC, [echo_address, kind], {"echo": [echo.pid]}))
        versions = [("before", args.before), ("after", None)] if args.before else [("", None)]
        for label, checkout in versions:
            suffix = f" ({label})" if label else ""
            with servers_from(checkout) as env:
                proxy = ChildServer("proxy", ["proxy", "--server_port", "0", "--devices", "1"], env=env)
                started.append(proxy)
                proxy.start()
                cluster = LocalCluster(islands=1, devices_per_host=1)
                started.append(cluster)
            clients.append(Client(f"proxy{suffix}", workload, [proxy.address, ""], {"proxy": [proxy.process.pid]}))
            cluster_pids = {
                "proxy": [cluster.proxy.process.pid],
                "worker": [w.process.pid for w in cluster.workers.values()],
            }
            clients.append(Client(f"cluster{suffix}", workload, [cluster.address, cluster.token], cluster_pids))
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
    what = "chained x = f(x), a burst waited for once" if args.chain else "float(f(x)) of a cached tiny jit"
    print(f"{what}, {args.rounds} x {args.burst} calls per path, interleaved\n")
    header = ("path", "p10 ms", "p50 ms", "p90 ms", "proxy CPU ms", "worker CPU ms", "echo CPU ms", "client CPU ms")
    print(f"{header[0]:<28} " + " ".join(f"{h:>13}" for h in header[1:]))
    for name, p10, p50, p90, *cpus in (client.row() for client in clients):
        print(f"{name:<28} {p10:>13.3f} {p50:>13.3f} {p90:>13.3f} " + " ".join(f"{c:>13}" for c in cpus))
    per = "program (the burst's mean)" if args.chain else "call"
    print(f"\n(wall and CPU ms per {per}; a single-process proxy's CPU is under proxy)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
