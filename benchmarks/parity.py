"""Parity with local JAX as the Pathways paper measures it: chained steps of a given length, steps/s over local.

    python benchmarks/parity.py [--targets_ms 0.5,1,2.3,5,10,35] [--seconds 1.5] [--rounds 3]

For each target step time, a chained one-device step (``x = tanh(x @ w) * 0.5 + x * 0.5``) is sized on
local JAX to take that long; then it runs for ``--seconds`` on local JAX and through the server, in
interleaved rounds (local, server, local, server, ...), and the table gives the median ratio of steps/s
through the server over local. The servers: ``pathways-nb proxy --devices 1`` and a cluster of one island
of one host with one device, one after the other in this process. The paper (its Figure 6) reaches parity
from about 2.3 ms per computation; the last line names the smallest step here at or above 0.97 of local.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import workloads

import pathways_nb
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.launch.processes import ChildServer

PARITY = 0.97


def _chain(device, size: int) -> Callable[[float], float]:
    """A function that runs the chained step of ``size`` on ``device`` for some seconds and returns steps/s."""
    w = jax.device_put(np.random.default_rng(2).random((size, size), dtype=np.float32) / size, device)
    step = jax.jit(lambda x, w: jnp.tanh(x @ w) * 0.5 + x * 0.5)
    x0 = step(w, w).block_until_ready()

    def steps_per_second(seconds: float) -> float:
        x, steps, started = x0, 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            for _ in range(16):  # dispatched back to back, waited for once: what completes, not what is queued
                x = step(x, w)
            x.block_until_ready()
            steps += 16
        return steps / (time.perf_counter() - started)

    return steps_per_second


def _size_for(target_ms: float, local) -> int:
    """The step's size on local JAX for ``target_ms`` (the smallest that takes about that long)."""

    def step_ms(size: int) -> float:
        return 1e3 / _chain(local, size)(0.3)

    return workloads.calibrate(step_ms, 16, target_ms)


def _ratios(sizes: dict[float, int], local, remote, seconds: float, rounds: int) -> dict[float, float]:
    """Median over ``rounds`` of remote steps/s over local steps/s, each round local then remote, per target."""
    ratios = {}
    for target, size in sizes.items():
        on_local, on_remote = _chain(local, size), _chain(remote, size)
        ratios[target] = statistics.median(on_remote(seconds) / on_local(seconds) for _ in range(rounds))
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--targets_ms", default="0.5,1,2.3,5,10,35", help="step times on local JAX to size the steps for (ms)"
    )
    parser.add_argument("--seconds", type=float, default=1.5, help="how long each measurement runs")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per step (the median is shown)")
    args = parser.parse_args()
    targets = [float(t) for t in args.targets_ms.split(",")]
    local = jax.devices("cpu")[0]
    sizes = {target: _size_for(target, local) for target in targets}
    measured_ms = {target: 1e3 / _chain(local, size)(args.seconds) for target, size in sizes.items()}
    servers = {}

    proxy = ChildServer("proxy", ["proxy", "--server_port", "0", "--devices", "1"])
    proxy.start()
    try:
        pathways_nb.connect(proxy.address, progress=False)
        servers["pathways-nb proxy --devices 1"] = _ratios(
            sizes, local, jax.devices("proxy")[0], args.seconds, args.rounds
        )
        pathways_nb.disconnect()
    finally:
        proxy.close()
    with LocalCluster(islands=1, devices_per_host=1) as cluster:
        pathways_nb.connect(cluster.address, progress=False)
        servers["cluster: 1 island x 1 host x 1 device"] = _ratios(
            sizes, local, jax.devices("proxy")[0], args.seconds, args.rounds
        )
        pathways_nb.disconnect()

    header = " | ".join(f"{measured_ms[t]:.2g} ms ({sizes[t]})" for t in targets)
    print(f"| step on local JAX (matrix size) | {header} |")
    print("|---|" + "---:|" * len(targets))
    for name, ratios in servers.items():
        print(f"| {name} | " + " | ".join(f"{ratios[t]:.2f}" for t in targets) + " |")
    print(f"(steps/s through the server over local JAX, median of {args.rounds} interleaved rounds)")
    for name, ratios in servers.items():
        at_parity = [t for t in targets if all(ratios[u] >= PARITY for u in targets if u >= t)]
        where = f"from {measured_ms[at_parity[0]]:.2g} ms on" if at_parity else "at none of these steps"
        print(f"{name}: at or above {PARITY} of local {where} (the paper: from about 2.3 ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
