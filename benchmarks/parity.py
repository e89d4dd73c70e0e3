"""Parity with local JAX as the Pathways paper measures it: chained steps of a given length, steps/s over local.

    python benchmarks/parity.py [--targets_ms 0.5,1,2.3,5,10,35] [--seconds 1.5] [--rounds 3] [--free_core]
                                [--wait_for_each_batch] [--platform cpu]

For each target step time, a chained step (``x = tanh(x @ w) * 0.5 + x * 0.5``) is sized on local JAX to
take that long on one device; then it runs for ``--seconds`` on local JAX and through a server
(dispatched back to back, a batch ahead of the devices; or, with ``--wait_for_each_batch``, each batch
waited for before the next), in interleaved rounds (local, server, local, server, ...), and the table
gives the median ratio of steps/s through the server over local. The servers, one after the other:
``pathways-nb proxy --devices 1``, a cluster of one island of one host with one device, and an island of
two hosts with one device each, whose step is the same matrices split by rows over its two devices
(against local JAX on two CPU devices). The paper (its Figure 6) reaches parity from about 2.3 ms per
computation; the last lines name, per server, the smallest step from which the ratio stays at or above
0.97.

Here the devices are this machine's cores, which the servers' own work shares. ``--free_core`` sizes
XLA's CPU thread pools, local JAX's and the servers', for one core fewer than the machine has (each
process starts pinned to the others, which is what XLA sizes its pools by, and is then let run
anywhere), so the control plane has a core that the devices do not use, as on an accelerator host;
the island of two hosts is left out then (local JAX with two CPU devices uses every core).
``--platform cuda`` (or ``tpu``) measures an accelerator instead: local JAX's and the servers'
(``benchmarks/accelerator_check.sh`` runs it so); the island of two hosts needs two of them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import workloads
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pathways_nb
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.launch.processes import ChildServer

PARITY = 0.97
_BATCH = 16  # steps dispatched back to back between waits
_ROWS = PartitionSpec("rows")


def _chain(devices: list, size: int, wait_for_each_batch: bool = False) -> Callable[[float], float]:
    """A function that runs the chained step of ``size`` over ``devices`` (split by rows) for some seconds
    and returns steps/s.

    The steps are dispatched back to back in batches of ``_BATCH``; before each batch the previous
    batch's first step is waited for, so that up to two batches are queued: the devices never wait
    for a dispatch, and a measurement does not run past its time by more than a batch (a server
    takes dispatches far faster than its devices run them). The rate counts what completed, the
    queue's drain included. With ``wait_for_each_batch`` each batch is waited for before the next
    one goes, as a loop that reads every batch's result does: every batch then adds a round trip,
    the devices idle from its last step's end until the next dispatch reaches them.
    """
    sharding = NamedSharding(Mesh(np.array(devices), ("rows",)), _ROWS)
    replicated = NamedSharding(sharding.mesh, PartitionSpec())
    w = jax.device_put(np.random.default_rng(2).random((size, size), dtype=np.float32) / size, replicated)
    step = jax.jit(lambda x, w: jnp.tanh(x @ w) * 0.5 + x * 0.5, out_shardings=sharding)
    x0 = step(jax.device_put(w, sharding), w).block_until_ready()

    def steps_per_second(seconds: float) -> float:
        x, steps, started = x0, 0, time.perf_counter()
        batch_start = x0
        while time.perf_counter() - started < seconds:
            (x if wait_for_each_batch else batch_start).block_until_ready()
            batch_start = x = step(x, w)
            for _ in range(_BATCH - 1):
                x = step(x, w)
            steps += _BATCH
        x.block_until_ready()
        return steps / (time.perf_counter() - started)

    return steps_per_second


def _size_for(target_ms: float, local: list) -> int:
    """The step's size on local JAX for ``target_ms`` (the smallest even one that takes about that long)."""

    def step_ms(size: int) -> float:
        return 1e3 / _chain(local, size)(0.3)

    size = workloads.calibrate(step_ms, 16, target_ms)
    return size + size % 2  # rows split over two devices as well


def _ratios(
    sizes: dict[float, int], local: list, remote: list, seconds: float, rounds: int, wait_for_each_batch: bool
) -> dict[float, float]:
    """Median over ``rounds`` of remote steps/s over local steps/s, each round local then remote, per target."""
    ratios = {}
    for target, size in sizes.items():
        on_local, on_remote = _chain(local, size, wait_for_each_batch), _chain(remote, size, wait_for_each_batch)
        ratios[target] = statistics.median(on_remote(seconds) / on_local(seconds) for _ in range(rounds))
    return ratios


def _other_steps(local, remote, seconds: float, rounds: int) -> dict[str, float]:
    """The issue's other figures, remote over local, median of interleaved rounds: a small Flax model's
    training step with Optax, and chained tiny programs (``x + 1``; the remote rate is given too)."""

    def median_ratio(rate) -> tuple[float, float]:
        pairs = [(rate(remote, seconds), rate(local, seconds)) for _ in range(rounds)]
        return statistics.median(r / loc for r, loc in pairs), statistics.median(loc for _, loc in pairs)

    flax, flax_local = median_ratio(workloads.flax_training_steps_per_second)
    tiny, tiny_local = median_ratio(workloads.tiny_programs_per_second)
    return {
        f"Flax MLP training step ({1e3 / flax_local:.2g} ms on local JAX)": flax,
        f"chained tiny programs ({tiny * tiny_local:,.0f}/s)": tiny,
    }


def _let_run_anywhere(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` and of its children may run on ``cores`` (their XLA pools keep their size)."""
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for thread in process.threads():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(thread.id, cores)


@contextlib.contextmanager
def _proxy(platform: str) -> Iterator[str]:
    server = ChildServer("proxy", ["proxy", "--server_port", "0", "--devices", "1", "--platform", platform])
    server.start()
    try:
        yield server.address
    finally:
        server.close()


@contextlib.contextmanager
def _cluster(hosts: int, platform: str) -> Iterator[str]:
    with LocalCluster(islands=1, hosts_per_island=hosts, devices_per_host=1, platform=platform) as cluster:
        yield cluster.address


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--targets_ms", default="0.5,1,2.3,5,10,35", help="step times on local JAX to size the steps for (ms)"
    )
    parser.add_argument("--seconds", type=float, default=1.5, help="how long each measurement runs")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per step (the median is shown)")
    parser.add_argument(
        "--free_core", action="store_true", help="XLA's CPU pools sized for one core fewer (the servers keep one)"
    )
    parser.add_argument(
        "--wait_for_each_batch",
        action="store_true",
        help=f"wait for each batch of {_BATCH} steps before the next (a round trip per batch); default: a batch ahead",
    )
    parser.add_argument("--platform", default="cpu", help="the devices: cpu (this machine's cores), cuda, tpu")
    args = parser.parse_args()
    targets = [float(t) for t in args.targets_ms.split(",")]
    cores = os.sched_getaffinity(0)
    if args.free_core:
        if len(cores) < 2:
            parser.error("--free_core needs at least two cores")
        pinned = set(sorted(cores)[1:])
        os.sched_setaffinity(0, pinned)  # local JAX and the servers size their pools by this
    if not args.free_core:  # XLA sizes a client of several CPU devices for every core, whatever the affinity
        jax.config.update("jax_num_cpu_devices", 2)
    local = jax.devices(args.platform)
    sizes = {target: _size_for(target, local[:1]) for target in targets}
    measured_ms = {target: 1e3 / _chain(local[:1], size)(args.seconds) for target, size in sizes.items()}
    servers = {
        "pathways-nb proxy --devices 1": (lambda: _proxy(args.platform), 1),
        "cluster: 1 island x 1 host x 1 device": (lambda: _cluster(1, args.platform), 1),
        "cluster: 1 island x 2 hosts x 1 device (a 2-device step)": (lambda: _cluster(2, args.platform), 2),
    }
    if len(local) < 2:
        del servers["cluster: 1 island x 2 hosts x 1 device (a 2-device step)"]
    results, others = {}, {}
    for name, (start, devices) in servers.items():
        if args.free_core:
            os.sched_setaffinity(0, pinned)  # again: the servers started from this thread inherit it
        with start() as address:
            pathways_nb.connect(address, progress=False)
            if args.free_core:
                _let_run_anywhere(os.getpid(), cores)
            remote = jax.devices("proxy")[:devices]
            results[name] = _ratios(sizes, local[:devices], remote, args.seconds, args.rounds, args.wait_for_each_batch)
            if devices == 1:
                others[name] = _other_steps(local[0], remote[0], args.seconds, args.rounds)
            pathways_nb.disconnect()

    header = " | ".join(f"{measured_ms[t]:.2g} ms ({sizes[t]})" for t in targets)
    print(f"| step on local JAX (matrix size) | {header} |")
    print("|---|" + "---:|" * len(targets))
    for name, ratios in results.items():
        print(f"| {name} | " + " | ".join(f"{ratios[t]:.2f}" for t in targets) + " |")
    pools = "one core fewer than the machine's" if args.free_core else "all the machine's cores"
    waits = "each batch of steps waited for" if args.wait_for_each_batch else "steps queued a batch ahead"
    print(
        f"(steps/s through the server over local JAX, median of {args.rounds} interleaved rounds; XLA on {pools}; "
        f"{waits})"
    )
    for name, figures in others.items():
        print(f"{name}: " + "; ".join(f"{what} {ratio:.2f} of local" for what, ratio in figures.items()))
    for name, ratios in results.items():
        at_parity = [t for t in targets if all(ratios[u] >= PARITY for u in targets if u >= t)]
        where = f"from {measured_ms[at_parity[0]]:.2g} ms on" if at_parity else "at none of these steps"
        print(f"{name}: at or above {PARITY} of local {where} (the paper: from about 2.3 ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
