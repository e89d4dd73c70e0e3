"""Islands of several hosts: aggregate throughput of several clients, and an SPMD step on 2x2 vs 1x4.

    python benchmarks/multihost.py [--seconds 8]

1. Small SPMD programs (a psum over the island's 4 devices) from 1, 2 and 4 client processes at
   once on one island of 2 hosts x 2 devices: the aggregate rate of several clients should reach
   at least one client's (the Pathways paper's multi-client result).
2. An SPMD training step (data-parallel MLP, batch sharded over 4 devices) on an island of
   2 hosts x 2 devices vs an island of 1 host x 4 devices: the ratio is the cost of the hosts'
   collectives (gloo over loopback here).
On one 2-core machine every process shares the same cores: ratios, not absolute rates, are what
this measures.
"""

from __future__ import annotations

import argparse
import json

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import python_process

SMALL_PROGRAMS = """
    import json, sys, time, jax, numpy as np, pathways_nb
    from functools import partial
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax.experimental.shard_map import shard_map
    pathways_nb.connect(sys.argv[1], token=sys.argv[2], tenant=sys.argv[3], progress=False)
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    step = jax.jit(partial(shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(lambda v: jax.lax.psum(v, "x") / 4))
    x = jax.device_put(np.ones((4, 8), np.float32), NamedSharding(mesh, P("x")))
    step(x).block_until_ready()
    print("ready", flush=True)
    sys.stdin.readline()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < float(sys.argv[4]):
        for _ in range(20):
            x = step(x)
        x.block_until_ready()                      # paced: what completes, not what is queued
        count += 20
    print(json.dumps({"programs": count, "seconds": time.perf_counter() - started}), flush=True)
"""

TRAINING_STEP = """
    import json, sys, time, jax, jax.numpy as jnp, numpy as np, pathways_nb
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    pathways_nb.connect(sys.argv[1], token=sys.argv[2], progress=False)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    rng = np.random.default_rng(0)
    params = [jax.device_put(rng.standard_normal(s, np.float32) / 16, NamedSharding(mesh, P()))
              for s in ((256, 512), (512, 512), (512, 10))]
    batch = jax.device_put(rng.standard_normal((1024, 256), np.float32), NamedSharding(mesh, P("data")))

    def loss(params, x):
        for w in params[:-1]:
            x = jnp.tanh(x @ w)
        return jnp.mean((x @ params[-1]) ** 2)

    step = jax.jit(lambda p, x: [w - 0.01 * g for w, g in zip(p, jax.grad(loss)(p, x))])
    params = step(params, batch)
    params[0].block_until_ready()
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < float(sys.argv[3]):
        for _ in range(4):
            params = step(params, batch)
        params[0].block_until_ready()              # paced, as in the programs above
        steps += 4
    print(json.dumps({"steps_per_s": steps / (time.perf_counter() - started)}), flush=True)
"""


def _aggregate(cluster: LocalCluster, clients: int, seconds: float) -> float:
    processes = [
        python_process(SMALL_PROGRAMS, cluster.address, cluster.token, f"client-{i}", str(seconds))
        for i in range(clients)
    ]
    for process in processes:
        assert process.stdout.readline().strip() == "ready", process.stderr.read()[-3000:]
    for process in processes:
        process.stdin.write("go\n")
        process.stdin.flush()
    results = []
    for process in processes:
        out, err = process.communicate(timeout=seconds + 120)
        if process.returncode != 0:
            raise RuntimeError(err[-3000:])
        results.append(json.loads(out.strip().splitlines()[-1]))
    return sum(r["programs"] for r in results) / max(r["seconds"] for r in results)


def _training(cluster: LocalCluster, seconds: float) -> float:
    process = python_process(TRAINING_STEP, cluster.address, cluster.token, str(seconds))
    out, err = process.communicate(timeout=seconds + 180)
    if process.returncode != 0:
        raise RuntimeError(err[-3000:])
    return json.loads(out.strip().splitlines()[-1])["steps_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each measurement runs")
    args = parser.parse_args()
    with LocalCluster(islands=1, hosts_per_island=2, devices_per_host=2) as two_hosts:
        rates = {n: _aggregate(two_hosts, n, args.seconds) for n in (1, 2, 4)}
        multi_host_steps = _training(two_hosts, args.seconds)
    with LocalCluster(islands=1, hosts_per_island=1, devices_per_host=4) as one_host:
        one_host_steps = _training(one_host, args.seconds)
    print("| clients on one 2x2 island | small SPMD programs/s (aggregate) | vs 1 client |")
    print("|---|---|---|")
    for clients, rate in rates.items():
        print(f"| {clients} | {rate:.0f} | {rate / rates[1]:.2f} |")
    print()
    print("| island | MLP training steps/s | ratio |")
    print("|---|---|---|")
    print(f"| 1 host x 4 devices | {one_host_steps:.1f} | 1.00 |")
    print(f"| 2 hosts x 2 devices | {multi_host_steps:.1f} | {multi_host_steps / one_host_steps:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
