"""Checkpoints through the workers (pathwaysutils persistence) vs through the notebook (Orbax's default), side by side.

    python benchmarks/checkpoints.py [--mib 1024] [--rounds 2] [--storage DIR]

Starts a LocalCluster of 2 islands x 2 CPU devices whose storage root is DIR (default: a new
directory in the temp dir, on disk; a directory in /dev/shm measures without the disk), and runs
clients as a Pathways on Cloud training script does (stock client, ``pathwaysutils.initialize()``,
Orbax's ``StandardCheckpointer(use_ocdbt=False)``), one fresh process per measurement:

- persistence (``ENABLE_PATHWAYS_PERSISTENCE=1``): each worker writes the shards it holds and
  reads the ones its devices need; no array byte passes through the proxy or the client;
- notebook (``ENABLE_PATHWAYS_PERSISTENCE=0``): Orbax's default handler brings every shard to the
  client (device -> host through the stock client) and writes it from there, and restores by
  reading in the client and uploading.

Each client makes a float32 array of MIB MiB sharded over the 4 devices on the devices themselves
(so that making it costs the client no memory), saves it, restores it with ``ShapeDtypeStruct`` +
``NamedSharding``, and checks on the devices that both are bitwise equal. It reports GB/s (the save
until ``wait_until_finished``, the restore until the array is ready), the growth of its own peak
RSS over the save and over the restore, and the bytes the proxy moved between client and devices
during the save (its upload and download events); this process samples the workers' resident
memory during the save (on CPU devices it includes the array itself, saved or not).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil

from pathways_nb.client.observe import Observer
from pathways_nb.launch.local_cluster import LocalCluster

CLIENT = """
    import json, resource, sys, time
    import pathwaysutils
    pathwaysutils.initialize()
    import jax, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

    path, mib = sys.argv[1], int(sys.argv[2])
    devices = jax.devices()[:4]
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    shape = (mib * 2**20 // (4 * 4096), 4096)
    # Each device makes its own shard (a program runs on one island; the array spans two).
    shards = [jax.jit(lambda i=i: jax.random.uniform(jax.random.key(i), (shape[0] // 4, shape[1])),
                      out_shardings=SingleDeviceSharding(d))() for i, d in enumerate(devices)]
    value = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    value.block_until_ready()
    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    handler = type(ocp.type_handlers.get_type_handler(jax.Array)).__name__
    checkpointer = ocp.StandardCheckpointer(use_ocdbt=False)
    print(json.dumps({"saving": time.time()}), flush=True)
    before = peak_mib()
    started = time.perf_counter()
    checkpointer.save(path, {"w": value})
    checkpointer.wait_until_finished()
    save_s, save_peak = time.perf_counter() - started, peak_mib() - before
    print(json.dumps({"saved": time.time()}), flush=True)
    target = {"w": jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding)}
    before = peak_mib()
    started = time.perf_counter()
    restored = checkpointer.restore(path, target)["w"]
    restored.block_until_ready()
    restore_s, restore_peak = time.perf_counter() - started, peak_mib() - before
    same = jax.jit(lambda a, b: jnp.all(a == b))  # shard by shard, on each shard's device
    by_device = {s.device: s.data for s in restored.addressable_shards}
    equal = all(bool(same(s.data, by_device[s.device])) for s in value.addressable_shards)
    print(json.dumps({"handler": handler, "nbytes": value.nbytes, "save_s": save_s, "restore_s": restore_s,
                      "save_peak_mib": save_peak, "restore_peak_mib": restore_peak, "equal": equal}), flush=True)
"""

PATHS = {"persistence": "1", "notebook": "0"}


class _WorkerMemory:
    """Samples the workers' resident memory (all of them, summed) every 50 ms while it runs."""

    def __init__(self, cluster: LocalCluster):
        self._processes = [psutil.Process(w.process.pid) for w in cluster.workers.values()]
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append((time.time(), sum(p.memory_info().rss for p in self._processes)))

    def __enter__(self) -> _WorkerMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def growth_mib(self, start: float, end: float) -> float:
        """The peak within [start, end] above the last sample before it."""
        before = [rss for t, rss in self.samples if t < start] or [self.samples[0][1]]
        during = [rss for t, rss in self.samples if start <= t <= end] or [before[-1]]
        return (max(during) - before[-1]) / 2**20


def _run_client(cluster: LocalCluster, observer: Observer, path_name: str, checkpoint: str, mib: int) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith("JAX_")}
    env.update(
        JAX_PLATFORMS="proxy",
        JAX_BACKEND_TARGET=cluster.address,
        IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true",
        ENABLE_PATHWAYS_PERSISTENCE=PATHS[path_name],
    )
    after = max((e.sequence for e in observer.events()), default=0)
    with _WorkerMemory(cluster) as memory:
        client = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CLIENT), checkpoint, str(mib)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    if client.returncode != 0:
        raise RuntimeError(f"the {path_name} client failed:\n{client.stderr[-4000:]}")
    lines = [json.loads(line) for line in client.stdout.splitlines() if line.startswith("{")]
    saving, saved, result = lines[0]["saving"], lines[1]["saved"], lines[2]
    moved = sum(
        e.bytes
        for e in observer.events(after=after)
        if e.kind in ("upload", "download") and saving <= e.start and e.end <= saved
    )
    return {**result, "proxy_bytes": moved, "workers_save_mib": memory.growth_mib(saving, saved)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="the array's size (default 1 GiB)")
    parser.add_argument("--rounds", type=int, default=2, help="measurements per path, alternating")
    parser.add_argument("--storage", default=None, help="the cluster's storage root (default: a new temp dir)")
    args = parser.parse_args()

    storage = args.storage or tempfile.mkdtemp(prefix="pathways-nb-checkpoints-")
    os.makedirs(storage, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name in PATHS}
    with LocalCluster(islands=2, devices_per_host=2, storage_root=storage) as cluster:
        print(f"cluster started in {cluster.startup_s:.1f} s, storage root {storage}", flush=True)
        observer = Observer(cluster.address, cluster.token)
        for round_index in range(args.rounds):
            for name in PATHS:
                checkpoint = os.path.join(storage, f"{name}-{round_index}")
                result = _run_client(cluster, observer, name, checkpoint, args.mib)
                shutil.rmtree(checkpoint, ignore_errors=True)
                if not result["equal"]:
                    raise RuntimeError(f"the {name} restore differs from what was saved")
                results[name].append(result)
                print(f"  {name} round {round_index + 1}: {json.dumps(result)}", flush=True)
        observer.close()
    if not args.storage:
        shutil.rmtree(storage, ignore_errors=True)
    _print(results, args.mib)
    return 0


def _print(results: dict[str, list[dict]], mib: int) -> None:
    def span(values: list[float], digits: int = 2) -> str:
        low, high = (f"{v:.{digits}f}" for v in (min(values), max(values)))
        return low if low == high else f"{low} to {high}" if low.startswith("-") else f"{low}-{high}"

    def gbps(result: dict, key: str) -> float:
        return result["nbytes"] / result[key] / 1e9

    print(f"\n{mib} MiB float32 over 2 islands x 2 CPU devices, {len(results['persistence'])} rounds per path")
    print(f"{'':<32} {'persistence':>14} {'notebook':>14} {'ratio':>12}")
    for label, key in (("save GB/s", "save_s"), ("restore GB/s", "restore_s")):
        persistence = [gbps(r, key) for r in results["persistence"]]
        notebook = [gbps(r, key) for r in results["notebook"]]
        ratios = [p / n for p, n in zip(persistence, notebook, strict=True)]
        print(f"{label:<32} {span(persistence):>14} {span(notebook):>14} {span(ratios, 1) + 'x':>12}")
    for label, key, digits in (
        ("client peak RSS growth, save", "save_peak_mib", 0),
        ("client peak RSS growth, restore", "restore_peak_mib", 0),
        ("workers' RSS growth, save", "workers_save_mib", 0),
    ):
        values = {name: span([r[key] for r in rs], digits) + " MiB" for name, rs in results.items()}
        print(f"{label:<32} {values['persistence']:>14} {values['notebook']:>14}")
    moved = {name: span([r["proxy_bytes"] / 2**20 for r in rs], 0) + " MiB" for name, rs in results.items()}
    print(f"{'bytes via the proxy, save':<32} {moved['persistence']:>14} {moved['notebook']:>14}")
    handlers = {name: rs[0]["handler"] for name, rs in results.items()}
    print(f"{'Orbax handler':<32} {handlers['persistence']:>14.14} {handlers['notebook']:>14.14}")


if __name__ == "__main__":
    sys.exit(main())
