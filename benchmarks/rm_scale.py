"""The resource manager at Pathways scale: simulated workers, a real resource manager, real gRPC.

    python benchmarks/rm_scale.py [--hosts 128,1024,4096] [--window 10] [--busy 1.0]

Per row it starts ``pathways-nb resource-manager --instance_count N --instance_type cpu:1x4`` as a
child process (with a cluster token), connects cluster watchers as a proxy does (``WatchCluster``,
asking for deltas), then starts simulated workers: real gRPC clients, each on its own connection
(as separate hosts are), in several processes of asyncio tasks, that register all at once and then
do what ``pathways_nb.worker.server`` does: attach (one stream kept open; the resource manager's
keepalive pings it; a load report when the load changed, at most once per interval the resource
manager hands out), or, with a resource manager that has no ``Attach`` (the code before it),
heartbeat on a stream at the interval it hands out, jittered, renewed every 10 s. ``--busy`` is the
share of workers whose load changes every interval (1.0, the default: every one of them, the worst
case). Once all are registered it measures the resource manager's CPU (its process's CPU time, apart from
the simulator's processes) for half a window with nothing else going on (liveness and load reports
alone), then over a window its CPU, memory (RSS), what watchers receive, and the latency of
``Allocate`` calls made back to back meanwhile, 20 ms apart (call to grant; then the allocation is
released), as the issue measured them.
"False unhealthy" counts the workers that were ever reported unhealthy to a watcher, or are now:
every simulated worker is alive throughout; "(steady)" those first reported once all had registered
and two seconds passed, "(all)" also those of the registration burst. After the window, one more
worker, alone in its own process, is stopped (SIGSTOP: its host vanishes without closing its connection), and the time
until a watcher sees it unhealthy is "vanished host found after".

To measure another checkout's resource manager (say, the code before a change), run from outside
any checkout with ``--rm_pythonpath DIR`` (DIR holding that ``pathways_nb``), so that the child
imports it rather than this one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import signal
import threading
import time

import grpc
import psutil
import tables

from pathways_nb.core import keepalive
from pathways_nb.core.security import METADATA_KEY, ClusterCredentials, generate_token
from pathways_nb.launch.processes import ChildServer
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.rpc import cluster_pb2_grpc

DEVICES_PER_HOST = 4


# -- the simulated workers (in their own processes) ----------------------------------------


def _register_request(island: int, port: int) -> pb.RegisterWorkerRequest:
    return pb.RegisterWorkerRequest(
        address=f"127.0.0.1:{port}",
        island=island,
        host_index=0,
        platform="cpu",
        platform_version="simulated",
        devices=[
            pb.LocalDevice(local_id=i, kind="cpu", memory_kinds=["unpinned_host"], debug_string=f"CpuDevice(id={i})")
            for i in range(DEVICES_PER_HOST)
        ],
        hostname="simulated",
        pid=1_000_000 + island,
        incarnation=1 + random.getrandbits(62),
    )


# Each simulated host on its own connection, as the resource manager's keepalive sees real hosts.
_PLAIN_CHANNEL = [("grpc.use_local_subchannel_pool", 1)]
_CHANNEL_OPTIONS = [*_PLAIN_CHANNEL, *keepalive.client_options()]


class _Stats:
    def __init__(self) -> None:
        self.messages = self.failed = self.reregistered = self.reattached = 0
        self.max_heartbeat_s = 0.0
        self.attached = self.heartbeating = 0


async def _simulate(address: str, token: str, islands: list[int], busy: float, go, stop, results) -> None:
    metadata = ((METADATA_KEY, f"Bearer {token}"),)  # what ClusterCredentials' channels send
    stats = _Stats()

    async def register(stub, request: pb.RegisterWorkerRequest) -> pb.RegisterWorkerResponse:
        while True:
            try:
                return await stub.RegisterWorker(request, timeout=60, metadata=metadata)
            except grpc.aio.AioRpcError:
                stats.failed += 1
                await asyncio.sleep(0.2)

    async def attached(stub, request: pb.RegisterWorkerRequest, loaded: bool) -> bool:
        """As pathways_nb.worker.server: registers on an Attach stream and keeps it open, reporting its
        load once per interval if it changed; False: the resource manager has no Attach."""
        call = stub.Attach(metadata=metadata)
        load = pb.WorkerLoad(sessions=1)
        try:
            await call.write(pb.WorkerUpdate(registration=request, load=load))
            reply = await call.read()
            if reply is grpc.aio.EOF:
                stats.failed += 1
                return True
            if not registered_at.get(request.island):
                registered_at[request.island] = time.time()
            stats.attached += 1
            interval_s = [reply.update_interval_s]

            async def follow() -> None:  # the resource manager lengthens the interval as the cluster grows
                with contextlib.suppress(grpc.aio.AioRpcError):
                    while (later := await call.read()) is not grpc.aio.EOF:
                        interval_s[0] = later.update_interval_s or interval_s[0]

            follower = asyncio.create_task(follow())
            while not stop.is_set() and not follower.done():  # until the stream breaks
                await asyncio.wait([follower], timeout=interval_s[0])
                if loaded and not stop.is_set() and not follower.done():
                    load.arrays += 1
                    load.array_bytes += 4096
                    await call.write(pb.WorkerUpdate(load=load))
                    stats.messages += 1
            if follower.done() and not stop.is_set():
                stats.reattached += 1  # broken: register on a new stream at once, as the worker does
            follower.cancel()
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                return False
            stats.failed += 1
            await asyncio.sleep(0.5)
        finally:
            call.cancel()
        return True

    async def heartbeating(stub, request: pb.RegisterWorkerRequest) -> None:
        """As the worker before Attach: registers, then heartbeats on a stream renewed every 10 s,
        jittered, at the interval the resource manager asks for."""
        registration = await register(stub, request)
        registered_at[request.island] = time.time()
        interval_s = registration.heartbeat_interval_s
        stats.heartbeating += 1
        while not stop.is_set():
            stream = stub.Heartbeats(timeout=10, metadata=metadata)
            try:
                while not stop.is_set():
                    await asyncio.sleep(interval_s * random.uniform(0.8, 1.0))
                    started = time.monotonic()
                    await stream.write(
                        pb.HeartbeatRequest(worker_id=registration.worker_id, incarnation=registration.incarnation)
                    )
                    reply = await stream.read()
                    if reply is grpc.aio.EOF:
                        break
                    stats.messages += 1
                    stats.max_heartbeat_s = max(stats.max_heartbeat_s, time.monotonic() - started)
                    interval_s = reply.heartbeat_interval_s or registration.heartbeat_interval_s
                    if not reply.known:
                        stats.reregistered += 1
                        registration = await register(stub, request)
                        interval_s = registration.heartbeat_interval_s
                        break
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                if await stream.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # not a renewal
                    stats.failed += 1
            finally:
                stream.cancel()

    async def worker(island: int) -> None:
        request = _register_request(island, 40000 + island)
        loaded = random.random() < busy
        async with grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
            stub = cluster_pb2_grpc.ResourceManagerStub(channel)
            while not stop.is_set():
                if not await attached(stub, request, loaded):
                    # The worker before Attach had no keepalive of its own (a resource manager of then
                    # refuses pings every 5 s): a plain channel, as it had.
                    async with grpc.aio.insecure_channel(address, options=_PLAIN_CHANNEL) as plain:
                        await heartbeating(cluster_pb2_grpc.ResourceManagerStub(plain), request)

    registered_at: dict[int, float] = {}
    results.put(("ready", os.getpid()))
    while not go.is_set():
        await asyncio.sleep(0.005)
    tasks = [asyncio.create_task(worker(island)) for island in islands]
    while len(registered_at) < len(islands):
        await asyncio.sleep(0.01)
    results.put(("registered", max(registered_at.values())))
    while not stop.is_set():
        await asyncio.sleep(0.05)
    for task in tasks:  # wherever each is (a stream, a registration that waits): the run is over
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    results.put(("stats", vars(stats)))


def _simulator_process(address: str, token: str, islands: list[int], busy: float, go, stop, results) -> None:
    asyncio.run(_simulate(address, token, islands, busy, go, stop, results))


# -- watchers and allocations (in this process) --------------------------------------------


class Watcher:
    """A proxy-style cluster watcher: merges worker entries by worker_id, counts what it receives."""

    def __init__(self, stub: cluster_pb2_grpc.ResourceManagerStub):
        self.messages = self.bytes = self.deltas = 0
        self.workers: dict[str, pb.WorkerState] = {}
        self.ever_unhealthy: set[str] = set()
        self.unhealthy_since: dict[str, float] = {}  # worker id -> when it was first seen unhealthy
        self._call = stub.WatchCluster(pb.ClusterStateRequest(deltas=True), wait_for_ready=True)
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            for state in self._call:
                self.messages += 1
                self.bytes += state.ByteSize()
                self.deltas += state.delta
                for worker in state.workers:
                    self.workers[worker.worker_id] = worker
                    if not worker.healthy:
                        self.ever_unhealthy.add(worker.worker_id)
                        self.unhealthy_since.setdefault(worker.worker_id, time.monotonic())
        except grpc.RpcError:
            pass

    def down(self) -> int:
        return sum(not w.healthy for w in self.workers.values())

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(5)


def _allocate_once(stub: cluster_pb2_grpc.ResourceManagerStub, index: int) -> float:
    """Seconds from the call to its grant; the allocation is released at once."""
    request = pb.AllocateRequest(tenant=f"bench{index % 4}", exclusive=index % 2 == 1, num_devices=4, timeout_s=10)
    started = time.perf_counter()
    call = stub.Allocate(request)
    for update in call:
        if update.HasField("granted"):
            elapsed = time.perf_counter() - started
            call.cancel()
            return elapsed
    raise RuntimeError("the allocation ended before it was granted")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def run_row(hosts: int, window_s: float, watchers: int, processes: int, busy: float, rm_pythonpath: str | None) -> dict:
    token = generate_token()
    credentials = ClusterCredentials(token=token)
    env = {**os.environ, **credentials.child_env()}
    if rm_pythonpath:
        env["PYTHONPATH"] = rm_pythonpath
    rm = ChildServer(
        "resource-manager",
        ["resource-manager", "--server_port", "0", "--instance_count", str(hosts), "--instance_type", "cpu:1x4"],
        env=env,
    )
    rm.start(60)
    rm_process = psutil.Process(rm.process.pid)
    context = multiprocessing.get_context("spawn")
    go, stop, results = context.Event(), context.Event(), context.Queue()
    simulators = []
    channel = credentials.channel(rm.hostport)
    followers: list[Watcher] = []
    try:
        stub = cluster_pb2_grpc.ResourceManagerStub(channel)
        followers = [Watcher(stub) for _ in range(watchers)]
        victim = hosts - 1  # alone in its own process, stopped after the window
        shards = [list(range(victim))[i::processes] for i in range(processes)] + [[victim]]
        simulators = [
            context.Process(target=_simulator_process, args=(rm.hostport, token, shard, busy, go, stop, results))
            for shard in shards
        ]
        for simulator in simulators:
            simulator.start()
        for _ in simulators:
            assert results.get(timeout=120)[0] == "ready"
        bring_up_cpu = _cpu_s(rm_process)
        started = time.time()
        go.set()
        done = [results.get(timeout=300)[1] for _ in simulators]
        registration_s = max(done) - started
        bring_up_cpu = (_cpu_s(rm_process) - bring_up_cpu) / max(registration_s, 1e-3)
        time.sleep(2.0)  # the streams (or the first heartbeats) after the burst
        settled_at = time.monotonic()

        sim_processes = [psutil.Process(s.pid) for s in simulators]
        quiet_before, quiet_started = _cpu_s(rm_process), time.monotonic()
        time.sleep(window_s / 2)  # liveness and load reports alone: no allocations, no watcher traffic but theirs
        rm_cpu_quiet = (_cpu_s(rm_process) - quiet_before) / (time.monotonic() - quiet_started)
        before = _cpu_s(rm_process)
        sim_before = sum(_cpu_s(p) for p in sim_processes)
        watched_before = [(w.bytes, w.messages) for w in followers]
        window_started = time.monotonic()
        latencies = []
        index = 0
        while time.monotonic() - window_started < window_s:
            latencies.append(_allocate_once(stub, index))
            index += 1
            time.sleep(0.02)
        elapsed = time.monotonic() - window_started
        rm_cpu = (_cpu_s(rm_process) - before) / elapsed
        sim_cpu = (sum(_cpu_s(p) for p in sim_processes) - sim_before) / elapsed
        rm_rss = rm_process.memory_info().rss
        watcher_bytes = sum(w.bytes - b for w, (b, _) in zip(followers, watched_before, strict=True)) / len(followers)
        watcher_messages = sum(w.messages - m for w, (_, m) in zip(followers, watched_before, strict=True)) / len(
            followers
        )
        state = stub.GetClusterState(pb.ClusterStateRequest(), timeout=30)
        unhealthy_now = {w.worker_id for w in state.workers if not w.healthy}
        ever = set(unhealthy_now).union(*(w.ever_unhealthy for w in followers))
        # Those first seen unhealthy since registration settled, or still unhealthy now.
        steady = set(unhealthy_now).union(
            w for f in followers for w, since in f.unhealthy_since.items() if since >= settled_at
        )
        attached = sum(w.attached for w in state.workers)

        # A host vanishes: its process stops without a word, its connection stays open.
        victim_id = f"island{victim}-host0"
        stopped_at = time.monotonic()
        os.kill(simulators[-1].pid, signal.SIGSTOP)
        while victim_id not in followers[0].unhealthy_since and time.monotonic() - stopped_at < 60:
            time.sleep(0.01)
        found_s = followers[0].unhealthy_since.get(victim_id, float("nan")) - stopped_at
        os.kill(simulators[-1].pid, signal.SIGCONT)

        stop.set()
        stats = []
        while len(stats) < len(simulators):
            kind, value = results.get(timeout=60)
            if kind == "stats":
                stats.append(value)
        return {
            "hosts": hosts,
            "devices": hosts * DEVICES_PER_HOST,
            "liveness": "attached" if attached else "heartbeats",
            "registration_s": registration_s,
            "bring_up_cpu": bring_up_cpu,
            "rm_cpu_quiet": rm_cpu_quiet,
            "rm_us_per_host": rm_cpu_quiet / hosts * 1e6,
            "rm_cpu": rm_cpu,
            "rm_rss_mib": rm_rss / (1 << 20),
            "false_unhealthy": len(ever),
            "false_unhealthy_steady": len(steady),
            "down_at_watcher": max(w.down() for w in followers),
            "found_s": found_s,
            "watcher_kb_s": watcher_bytes / elapsed / 1024,
            "watcher_msgs_s": watcher_messages / elapsed,
            "state_kb": state.ByteSize() / 1024,
            "allocate_p50_ms": _percentile(latencies, 0.5) * 1e3,
            "allocate_p90_ms": _percentile(latencies, 0.9) * 1e3,
            "allocate_p99_ms": _percentile(latencies, 0.99) * 1e3,
            "allocations": len(latencies),
            "messages_s": sum(s["messages"] for s in stats) / (time.time() - started),
            "reregistered": sum(s["reregistered"] for s in stats),
            "reattached": sum(s["reattached"] for s in stats),
            "sim_cpu": sim_cpu,
        }
    finally:
        stop.set()
        for follower in followers:
            follower.close()
        for simulator in simulators:
            if simulator.pid is not None and simulator.is_alive():
                os.kill(simulator.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        for simulator in simulators:
            simulator.join(max(0.1, deadline - time.monotonic()))
            if simulator.is_alive():
                simulator.kill()
        channel.close()
        rm.close()


COLUMNS = [
    ("hosts", "hosts", "{}"),
    ("devices", "devices", "{}"),
    ("liveness", "liveness", "{}"),
    ("registration_s", "register all (s)", "{:.2f}"),
    ("bring_up_cpu", "RM CPU bring-up (cores)", "{:.2f}"),
    ("rm_cpu_quiet", "RM CPU, no allocations (cores)", "{:.3f}"),
    ("rm_us_per_host", "of which per host (µs/s)", "{:.0f}"),
    ("rm_cpu", "RM CPU, allocating (cores)", "{:.3f}"),
    ("rm_rss_mib", "RM RSS (MiB)", "{:.0f}"),
    ("messages_s", "messages/s", "{:.0f}"),
    ("allocate_p50_ms", "Allocate p50 (ms)", "{:.1f}"),
    ("allocate_p99_ms", "Allocate p99 (ms)", "{:.1f}"),
    ("false_unhealthy", "false unhealthy (all)", "{}"),
    ("false_unhealthy_steady", "false unhealthy (steady)", "{}"),
    ("found_s", "vanished host found after (s)", "{:.1f}"),
    ("watcher_kb_s", "watcher KB/s", "{:.1f}"),
    ("reregistered", "re-registrations", "{}"),
    ("reattached", "streams broken", "{}"),
    ("sim_cpu", "simulator CPU (cores)", "{:.2f}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="128,1024,4096", help="comma-separated host counts, one row each")
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured per row, after registration")
    parser.add_argument("--watchers", type=int, default=1, help="cluster watchers connected, as proxies are")
    parser.add_argument(
        "--processes", type=int, default=0, help="simulator processes (asyncio tasks inside); 0: one per 128 hosts"
    )
    parser.add_argument("--busy", type=float, default=1.0, help="share of workers whose load changes every interval")
    parser.add_argument("--rm_pythonpath", default=None, help="PYTHONPATH of the resource manager (another checkout)")
    args = parser.parse_args()
    rows = []
    for hosts in [int(h) for h in args.hosts.split(",")]:
        processes = args.processes or max(2, hosts // 128)
        rows.append(run_row(hosts, args.window, args.watchers, processes, args.busy, args.rm_pythonpath))
        print(rows[-1], flush=True)
    print(tables.markdown(rows, COLUMNS))


if __name__ == "__main__":
    main()
