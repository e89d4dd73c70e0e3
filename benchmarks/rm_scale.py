"""The resource manager at Pathways scale: simulated workers, a real resource manager, real gRPC.

    python benchmarks/rm_scale.py [--hosts 16,64,128,256,512] [--window 5]

Per row it starts ``pathways-nb resource-manager --instance_count N --instance_type cpu:1x4`` as a
child process (with a cluster token), connects cluster watchers as a proxy does (``WatchCluster``,
asking for deltas), then starts simulated workers: real gRPC clients, in two processes of asyncio
tasks, that register all at once and heartbeat (on a stream; a call each with an older resource
manager) at the interval it hands out, jittered, registering again when it does not know them, as
``pathways_nb.worker.server`` does. Once all are
registered it measures, over a window, the resource manager's CPU (its process's CPU time, apart
from the simulator's), what watchers receive, and the latency of ``Allocate`` calls made meanwhile
(call to grant; then the allocation is released). "False unhealthy" counts the workers that were
ever reported unhealthy to a watcher, or are now: every simulated worker is alive throughout.

To measure another checkout's resource manager (say, the code before a change), run from outside
any checkout with ``--rm_pythonpath DIR`` (DIR holding that ``pathways_nb``), so that the child
imports it rather than this one.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import threading
import time

import grpc
import psutil

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


async def _simulate(address: str, token: str, islands: list[int], go, stop, results) -> None:
    metadata = ((METADATA_KEY, f"Bearer {token}"),)  # what ClusterCredentials' channels send
    stats = {"heartbeats": 0, "failed": 0, "reregistered": 0, "max_heartbeat_s": 0.0}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = cluster_pb2_grpc.ResourceManagerStub(channel)
        await channel.channel_ready()

        async def register(request: pb.RegisterWorkerRequest) -> pb.RegisterWorkerResponse:
            while True:
                try:
                    return await stub.RegisterWorker(request, timeout=30, metadata=metadata)
                except grpc.aio.AioRpcError:
                    stats["failed"] += 1
                    await asyncio.sleep(0.2)

        async def worker(island: int) -> None:
            """As pathways_nb.worker.server: heartbeats on a stream renewed every 10 s (a call each, for a
            resource manager without that stream), jittered, at the interval the resource manager asks for."""
            request = _register_request(island, 40000 + island)
            registration = await register(request)
            registered.append(time.time())
            interval_s = registration.heartbeat_interval_s
            streaming = True
            while not stop.is_set():
                stream = stub.Heartbeats(timeout=10, metadata=metadata) if streaming else None
                try:
                    while not stop.is_set():
                        await asyncio.sleep(interval_s * random.uniform(0.8, 1.0))
                        started = time.monotonic()
                        beat = pb.HeartbeatRequest(
                            worker_id=registration.worker_id, incarnation=registration.incarnation
                        )
                        if stream is None:
                            reply = await stub.Heartbeat(beat, timeout=5, metadata=metadata)
                        else:
                            await stream.write(beat)
                            reply = await stream.read()
                            if reply is grpc.aio.EOF:
                                break
                        stats["heartbeats"] += 1
                        stats["max_heartbeat_s"] = max(stats["max_heartbeat_s"], time.monotonic() - started)
                        interval_s = reply.heartbeat_interval_s or registration.heartbeat_interval_s
                        if not reply.known:
                            stats["reregistered"] += 1
                            registration = await register(request)
                            interval_s = registration.heartbeat_interval_s
                            break
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as error:
                    code = await stream.code() if stream is not None else error.code()
                    if code == grpc.StatusCode.UNIMPLEMENTED:  # an older resource manager
                        streaming = False
                    elif code != grpc.StatusCode.DEADLINE_EXCEEDED:  # not a renewal
                        stats["failed"] += 1
                finally:
                    if stream is not None:
                        stream.cancel()

        registered: list[float] = []
        results.put(("ready", os.getpid()))
        while not go.is_set():
            await asyncio.sleep(0.005)
        tasks = [asyncio.create_task(worker(island)) for island in islands]
        while len(registered) < len(islands):
            await asyncio.sleep(0.01)
        results.put(("registered", max(registered)))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks, return_exceptions=True)
    results.put(("stats", stats))


def _simulator_process(address: str, token: str, islands: list[int], go, stop, results) -> None:
    asyncio.run(_simulate(address, token, islands, go, stop, results))


# -- watchers and allocations (in this process) --------------------------------------------


class Watcher:
    """A proxy-style cluster watcher: merges worker entries by worker_id, counts what it receives."""

    def __init__(self, stub: cluster_pb2_grpc.ResourceManagerStub):
        self.messages = self.bytes = self.deltas = 0
        self.workers: dict[str, pb.WorkerState] = {}
        self.ever_unhealthy: set[str] = set()
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


def run_row(hosts: int, window_s: float, watchers: int, processes: int, rm_pythonpath: str | None) -> dict:
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
        shards = [list(range(hosts))[i::processes] for i in range(processes)]
        simulators = [
            context.Process(target=_simulator_process, args=(rm.hostport, token, shard, go, stop, results))
            for shard in shards
        ]
        for simulator in simulators:
            simulator.start()
        for _ in simulators:
            assert results.get(timeout=60)[0] == "ready"
        bring_up_cpu = rm_process.cpu_times()
        started = time.time()
        go.set()
        done = [results.get(timeout=120)[1] for _ in simulators]
        registration_s = max(done) - started
        bring_up = rm_process.cpu_times()
        bring_up_cpu = (bring_up.user + bring_up.system - bring_up_cpu.user - bring_up_cpu.system) / max(
            registration_s, 1e-3
        )
        time.sleep(1.0)  # the first heartbeats after the burst

        sim_processes = [psutil.Process(s.pid) for s in simulators]
        before = rm_process.cpu_times()
        sim_before = sum(sum(p.cpu_times()[:2]) for p in sim_processes)
        watched_before = [(w.bytes, w.messages) for w in followers]
        window_started = time.monotonic()
        latencies = []
        index = 0
        while time.monotonic() - window_started < window_s:
            latencies.append(_allocate_once(stub, index))
            index += 1
            time.sleep(0.02)
        elapsed = time.monotonic() - window_started
        after = rm_process.cpu_times()
        sim_after = sum(sum(p.cpu_times()[:2]) for p in sim_processes)
        rm_cpu = (after.user + after.system - before.user - before.system) / elapsed
        watcher_bytes = sum(w.bytes - b for w, (b, _) in zip(followers, watched_before, strict=True)) / len(followers)
        watcher_messages = sum(w.messages - m for w, (_, m) in zip(followers, watched_before, strict=True)) / len(
            followers
        )
        state = stub.GetClusterState(pb.ClusterStateRequest(), timeout=30)
        unhealthy_now = {w.worker_id for w in state.workers if not w.healthy}
        ever = set(unhealthy_now).union(*(w.ever_unhealthy for w in followers))
        stop.set()
        stats = []
        while len(stats) < len(simulators):
            kind, value = results.get(timeout=30)
            if kind == "stats":
                stats.append(value)
        return {
            "hosts": hosts,
            "devices": hosts * DEVICES_PER_HOST,
            "registration_s": registration_s,
            "bring_up_cpu": bring_up_cpu,
            "rm_cpu": rm_cpu,
            "sim_cpu": (sim_after - sim_before) / elapsed,
            "false_unhealthy": len(ever),
            "down_at_watcher": max(w.down() for w in followers),
            "watcher_kb_s": watcher_bytes / elapsed / 1024,
            "watcher_msgs_s": watcher_messages / elapsed,
            "state_kb": state.ByteSize() / 1024,
            "allocate_p50_ms": _percentile(latencies, 0.5) * 1e3,
            "allocate_p90_ms": _percentile(latencies, 0.9) * 1e3,
            "allocate_p99_ms": _percentile(latencies, 0.99) * 1e3,
            "allocations": len(latencies),
            "heartbeats_s": sum(s["heartbeats"] for s in stats) / (time.time() - started),
            "reregistered": sum(s["reregistered"] for s in stats),
            "max_heartbeat_ms": max(s["max_heartbeat_s"] for s in stats) * 1e3,
            "interval_s": stub.Heartbeat(pb.HeartbeatRequest(), timeout=10).heartbeat_interval_s,
        }
    finally:
        stop.set()
        for follower in followers:
            follower.close()
        for simulator in simulators:
            simulator.join(30)
            if simulator.is_alive():
                simulator.kill()
        channel.close()
        rm.close()


COLUMNS = [
    ("hosts", "hosts", "{}"),
    ("devices", "devices", "{}"),
    ("registration_s", "register all (s)", "{:.2f}"),
    ("bring_up_cpu", "RM CPU bring-up (cores)", "{:.2f}"),
    ("rm_cpu", "RM CPU steady (cores)", "{:.3f}"),
    ("false_unhealthy", "false unhealthy", "{}"),
    ("down_at_watcher", "down at watcher (end)", "{}"),
    ("watcher_kb_s", "watcher KB/s", "{:.1f}"),
    ("watcher_msgs_s", "watcher msgs/s", "{:.1f}"),
    ("state_kb", "ClusterState KB", "{:.0f}"),
    ("allocate_p50_ms", "Allocate p50 (ms)", "{:.1f}"),
    ("allocate_p90_ms", "Allocate p90 (ms)", "{:.1f}"),
    ("allocate_p99_ms", "Allocate p99 (ms)", "{:.1f}"),
    ("interval_s", "heartbeat interval (s)", "{:.2f}"),
    ("heartbeats_s", "heartbeats/s", "{:.0f}"),
    ("max_heartbeat_ms", "slowest heartbeat (ms)", "{:.0f}"),
    ("reregistered", "re-registrations", "{}"),
    ("sim_cpu", "simulator CPU (cores)", "{:.2f}"),
]


def table(rows: list[dict]) -> str:
    lines = [
        "| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|" + "|".join("---:" for _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="16,64,128,256,512", help="comma-separated host counts, one row each")
    parser.add_argument("--window", type=float, default=5.0, help="seconds measured per row, after registration")
    parser.add_argument("--watchers", type=int, default=1, help="cluster watchers connected, as proxies are")
    parser.add_argument("--processes", type=int, default=2, help="simulator processes (asyncio tasks inside)")
    parser.add_argument("--rm_pythonpath", default=None, help="PYTHONPATH of the resource manager (another checkout)")
    args = parser.parse_args()
    rows = []
    for hosts in [int(h) for h in args.hosts.split(",")]:
        rows.append(run_row(hosts, args.window, args.watchers, args.processes, args.rm_pythonpath))
        print(rows[-1], flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
