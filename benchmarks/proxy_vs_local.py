"""Through the single-process proxy vs plain local JAX, side by side in one run.

    python benchmarks/proxy_vs_local.py [--quick]

Starts ``pathways-nb proxy`` with one CPU device on this machine, connects this
process to it, and runs each workload on the server's device and on this
process's own CPU device. Targets on a 2-core machine: >= 5,000 tiny chained
programs/s, >= 1 GB/s each way for 64 MiB, a ~10 ms compute step within 5% of local.
"""

from __future__ import annotations

import argparse

import jax
import workloads

import pathways_nb
from pathways_nb.processes import ChildServer


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
        pathways_nb.disconnect()
    finally:
        server.close()
    workloads.print_table(rows, "local JAX", "via proxy")
    print("(ratio: proxy throughput / local throughput; for ms/step, local time / proxy time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
