"""One program across islands (multislice): training throughput over two islands vs one, and the DCN's bandwidth.

    python benchmarks/multislice.py [--seconds 8] [--sizes_mib 4,16,64,256]

1. The paper's two-island figure: a data-parallel training step (an MLP, the global batch split over
   every device, the gradient averaged over all of them) on 2 islands x 1 host x 2 devices, where the
   average crosses islands, vs the same global batch on 1 island of 2 hosts x 2 devices (same hosts and
   devices, one island) and on 1 island of 1 host x 4 devices. The Pathways paper reports a model
   sharded across two islands at throughput comparable to one island (~97%).
2. The network between islands: an all-reduce (psum) over both islands' devices of 4 MiB to 256 MiB
   per device, as GB/s of each device's data, beside a copy of the same bytes from island 0 to island 1.
On one 2-core machine every process shares the same cores and "the network" is loopback: ratios, not
absolute rates, are what this measures.
"""

from __future__ import annotations

import argparse
import json

import tables

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import python_process

TRAINING_STEP = """
    import json, sys, time, jax, jax.numpy as jnp, numpy as np, pathways_nb
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    pathways_nb.connect(sys.argv[1], token=sys.argv[2], progress=False)
    devices = jax.devices()
    islands = len({d.slice_index for d in devices})
    grid = mesh_utils.create_hybrid_device_mesh((1, 4 // islands), (islands, 1), devices)
    mesh = Mesh(grid, ("dcn", "ici"))
    rng = np.random.default_rng(0)
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(("dcn", "ici")))
    params = [jax.device_put(rng.standard_normal(s, np.float32) / 16, replicated)
              for s in ((256, 1024), (1024, 1024), (1024, 10))]
    x = jax.device_put(rng.standard_normal((2048, 256), np.float32), batch)

    def loss(params, x):
        for w in params[:-1]:
            x = jnp.tanh(x @ w)
        return jnp.mean((x @ params[-1]) ** 2)

    step = jax.jit(lambda p, x: [w - 0.01 * g for w, g in zip(p, jax.grad(loss)(p, x))])
    for _ in range(3):
        params = step(params, x)
    params[0].block_until_ready()
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < float(sys.argv[3]):
        for _ in range(4):
            params = step(params, x)
        params[0].block_until_ready()              # paced: what completes, not what is queued
        steps += 4
    print(json.dumps({"steps_per_s": steps / (time.perf_counter() - started)}), flush=True)
"""

DCN = """
    import json, sys, time, jax, numpy as np, pathways_nb
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    pathways_nb.connect(sys.argv[1], token=sys.argv[2], progress=False)
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("x",))
    everywhere = NamedSharding(mesh, P("x"))
    psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    island1 = [d for d in devices if d.slice_index == 1][0]
    island0 = [d for d in devices if d.slice_index == 0][0]
    rows = []

    def timed(function, repeats=3):
        function()
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            function()
            best = min(best, time.perf_counter() - started)
        return best

    for mib in [int(s) for s in sys.argv[3].split(",")]:
        per_device = (mib << 20) // 4
        x = jax.device_put(np.ones(per_device * len(devices), np.float32), everywhere)
        one = jax.device_put(np.ones(per_device, np.float32), island0)
        reduce_s = timed(lambda: psum(x).block_until_ready())
        copy_s = timed(lambda: jax.device_put(one, island1).block_until_ready())
        rows.append({"mib": mib, "psum_gbps": (mib << 20) / reduce_s / 1e9, "copy_gbps": (mib << 20) / copy_s / 1e9})
    print(json.dumps(rows), flush=True)
"""


def _run(cluster: LocalCluster, code: str, *args: str) -> object:
    process = python_process(code, cluster.address, cluster.token, *args)
    out, err = process.communicate(timeout=900)
    if process.returncode != 0:
        raise RuntimeError(err[-3000:])
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each training measurement runs")
    parser.add_argument("--sizes_mib", default="4,16,64,256", help="all-reduce sizes, MiB per device")
    args = parser.parse_args()
    rows = []
    with LocalCluster(islands=2, hosts_per_island=1, devices_per_host=2) as two_islands:
        rows.append({"shape": "2 islands x 1 host x 2 devices", **_run(two_islands, TRAINING_STEP, str(args.seconds))})
        dcn = _run(two_islands, DCN, args.sizes_mib)
    for islands, hosts, devices in ((1, 2, 2), (1, 1, 4)):
        with LocalCluster(islands=islands, hosts_per_island=hosts, devices_per_host=devices) as one_island:
            shape = f"1 island x {hosts} host{'s' if hosts > 1 else ''} x {devices} devices"
            rows.append({"shape": shape, **_run(one_island, TRAINING_STEP, str(args.seconds))})
    reference = rows[1]["steps_per_s"]
    for row in rows:
        row["ratio"] = row["steps_per_s"] / reference
    print(
        tables.markdown(
            rows,
            [
                ("shape", "cluster", "{}"),
                ("steps_per_s", "MLP steps/s", "{:.2f}"),
                ("ratio", "vs 1 island, same hosts", "{:.2f}"),
            ],
        )
    )
    print()
    for row in dcn:
        row["ratio"] = row["psum_gbps"] / row["copy_gbps"]
    print(
        tables.markdown(
            dcn,
            [
                ("mib", "MiB per device", "{}"),
                ("psum_gbps", "all-reduce across islands, GB/s", "{:.2f}"),
                ("copy_gbps", "copy island 0 to island 1, GB/s", "{:.2f}"),
                ("ratio", "ratio", "{:.2f}"),
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
