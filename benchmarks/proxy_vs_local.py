"""Through the single-process proxy vs plain local JAX, side by side in one run.

    python benchmarks/proxy_vs_local.py [--quick]

Starts ``pathways-nb proxy`` with one CPU device on this machine, connects this
process to it, and runs each workload on the server's device and on this
process's own CPU device. Targets on a 2-core machine: >= 5,000 tiny chained
programs/s, 64 MiB host -> device >= 2 GB/s (and >= local JAX), device -> host
>= 1.5 GB/s, a ~10 ms compute step within 5% of local.

Uploads go through shared memory here (client and proxy share the host); run
with ``PATHWAYS_SHARED_MEMORY=0`` for the gRPC path. Wall times swing with
other load on the machine, so the run ends with what one 64 MiB transfer costs
in CPU time, client and server apart, which load changes much less.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np
import psutil
import workloads

import pathways_nb
from pathways_nb.client import jax_plugin
from pathways_nb.launch.processes import ChildServer

MIB = 1 << 20


def transfer_cpu_ms(device, server: psutil.Process, repeats: int) -> list[tuple[str, float, float, float]]:
    """(direction, wall, client CPU, server CPU) in ms for one 64 MiB transfer, the least of ``repeats``."""
    host = np.random.default_rng(2).random(64 * MIB // 4, dtype=np.float32)
    costs: dict[str, list[tuple[float, float, float]]] = {"host -> device": [], "device -> host": []}

    def timed(direction: str, work, *args):
        server_before, client_before, started = sum(server.cpu_times()[:2]), time.process_time(), time.perf_counter()
        result = work(*args)
        wall, client = time.perf_counter() - started, time.process_time() - client_before
        costs[direction].append((wall, client, sum(server.cpu_times()[:2]) - server_before))
        return result

    for _ in range(repeats + 1):
        on_device = timed("host -> device", lambda: jax.device_put(host, device).block_until_ready())
        assert timed("device -> host", np.asarray, on_device).tobytes() == host.tobytes()
        del on_device
    return [
        (direction, *(1000 * min(sample[k] for sample in samples[1:]) for k in range(3)))
        for direction, samples in costs.items()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test)")
    args = parser.parse_args()
    seconds, repeats, steps = (1.0, 3, 30) if args.quick else (4.0, 8, 200)

    server = ChildServer("proxy", ["proxy", "--server_port", "0", "--devices", "1"])
    server.start()
    try:
        pathways_nb.connect(server.address)
        remote, local = jax.devices("proxy")[0], jax.devices("cpu")[0]
        size = workloads.calibrate(lambda n: workloads.compute_step_ms(local, n, 5), 256, 10.0)
        rows = []

        def step_ms(device):
            return workloads.compute_step_ms(device, size, steps)

        for name, unit, higher_is_better, measure in [
            ("tiny chained programs", "programs/s", True, lambda d: workloads.tiny_programs_per_second(d, seconds)),
            ("64 MiB host -> device", "GB/s", True, lambda d: workloads.host_to_device_gbps(d, 64, repeats)),
            ("64 MiB device -> host", "GB/s", True, lambda d: workloads.device_to_host_gbps(d, 64, repeats)),
            (
                f"compute step ({size}x{size} matmul)",
                "ms/step",
                False,
                lambda d: workloads.compute_step_ms(d, size, steps),
            ),
        ]:
            local_value, remote_value = measure(local), measure(remote)
            ratio = remote_value / local_value if higher_is_better else local_value / remote_value
            rows.append((name, unit, local_value, remote_value, ratio))
        costs = transfer_cpu_ms(remote, psutil.Process(server.process.pid), repeats)
        shared = bool(os.environ.get(jax_plugin.DIRECTORY_ENV))
        pathways_nb.disconnect()
    finally:
        server.close()
    workloads.print_table(rows, "local JAX", "via proxy")
    print("(ratio: proxy throughput / local throughput; for ms/step, local time / proxy time)")
    print(f"\n64 MiB via proxy, uploads {'through shared memory' if shared else 'over gRPC'}:")
    print(f"{'direction':<16} {'wall ms':>8} {'client CPU ms':>14} {'server CPU ms':>14}")
    for direction, wall, client, server_cpu in costs:
        print(f"{direction:<16} {wall:>8.1f} {client:>14.1f} {server_cpu:>14.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
