"""Through a 2-island LocalCluster vs plain local JAX, side by side in one run.

    python benchmarks/cluster_vs_local.py [--quick] [--transfers]

Starts a LocalCluster (resource manager, two workers of one CPU device each,
proxy) on this machine and connects this process to it. Targets: an MLP
training step (~20-50 ms) at >= 0.95 of local throughput (the Pathways
paper's "~100% utilization"), and a 2-stage pipeline across islands at about
the throughput of the same stages on one island (the paper reports ~97%).
On one 2-core machine the two islands share the same cores, so a pipeline
cannot gain from running its stages in parallel here.

The 64 MiB transfer rows (``--transfers``: only those) go through the whole
path: client -> proxy -> worker and back, and worker -> worker between
islands. On one host the proxy and the workers pass the bytes through shared
memory; ``PATHWAYS_SHARED_MEMORY=0`` in the environment measures gRPC instead.
"""

from __future__ import annotations

import argparse

import jax
import workloads

import pathways_nb
from pathways_nb.launch.local_cluster import LocalCluster


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test)")
    parser.add_argument("--transfers", action="store_true", help="only the 64 MiB transfer rows")
    args = parser.parse_args()
    seconds, repeats, steps, microbatches = (1.0, 3, 10, 8) if args.quick else (4.0, 6, 60, 32)

    with LocalCluster(islands=2, devices_per_host=1) as cluster:
        print(f"cluster started in {cluster.startup_s:.1f} s")
        pathways_nb.connect(cluster.address)
        island0, island1 = jax.devices("proxy")
        local = jax.devices("cpu")[0]
        rows = []

        def compare(name, unit, local_value, remote_value, higher_is_better=True):
            ratio = remote_value / local_value if higher_is_better else local_value / remote_value
            rows.append((name, unit, local_value, remote_value, ratio))

        compare(
            "64 MiB host -> device",
            "GB/s",
            workloads.host_to_device_gbps(local, 64, repeats),
            workloads.host_to_device_gbps(island0, 64, repeats),
        )
        compare(
            "64 MiB device -> host",
            "GB/s",
            workloads.device_to_host_gbps(local, 64, repeats),
            workloads.device_to_host_gbps(island0, 64, repeats),
        )
        compare(
            "64 MiB island 0 -> island 1",
            "GB/s",
            workloads.host_to_device_gbps(local, 64, repeats),
            workloads.device_to_device_gbps(island0, island1, 64, repeats),
        )
        if args.transfers:
            pathways_nb.disconnect()
            workloads.print_table(rows, "local JAX", "cluster")
            return 0
        width = workloads.calibrate(lambda n: 1e3 / workloads.mlp_steps_per_second(local, n, 256, 3), 256, 30.0)

        compare(
            "tiny chained programs",
            "programs/s",
            workloads.tiny_programs_per_second(local, seconds),
            workloads.tiny_programs_per_second(island0, seconds),
        )
        compare(
            f"MLP training step (3x{width}, batch 256)",
            "steps/s",
            workloads.mlp_steps_per_second(local, width, 256, steps),
            workloads.mlp_steps_per_second(island0, width, 256, steps),
        )
        pipeline = (
            workloads.pipeline_microbatches_per_second(island0, island0, width, 256, microbatches),
            workloads.pipeline_microbatches_per_second(island0, island1, width, 256, microbatches),
        )
        compare("2-stage pipeline: across vs one island", "microbatch/s", *pipeline)
        pathways_nb.disconnect()
    workloads.print_table(rows, "local JAX", "cluster")
    print(
        "(ratio: cluster / local; the transfer row compares with a local host -> device copy,\n"
        " the pipeline row with the same stages both on island 0 of the cluster)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
