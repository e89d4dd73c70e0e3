"""What colocated Python costs: call latency (first, later, 64 MiB input) and an executor's memory.

    python benchmarks/colocated_python.py [--rounds 20]

Starts a 1-island LocalCluster with colocated Python (executors as users of their own where this
machine allows) and a client that times, end to end (the call and reading its result):

- the session's first call: the executor starts (it imports jax), then jax's three programs;
- a first call of another function: three programs on a running executor;
- later calls of a function (one program each), and of a specialized one;
- the same tiny computation as an XLA program on the same colocated CPU device, for scale;
- a call whose input is 64 MiB (its result a scalar), and one whose input and output are 64 MiB;

then the resident memory of the executor, its host's supervisor and the worker. Run it on a
quiet machine; on a shared one, run it twice and report the range.
"""

from __future__ import annotations

import argparse
import json

import psutil

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import other_users_python, python_process

CLIENT = """
import json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np, pathways_nb
from jax.experimental import colocated_python as cp

pathways_nb.connect(sys.argv[1], token=sys.argv[2], progress=False)
rounds = int(sys.argv[3])
cpu = cp.colocated_cpu_devices(jax.devices())[0]
small = jax.device_put(np.ones(4, np.float32), cpu)
big = jax.device_put(np.ones(16 << 20, np.float32), cpu)  # 64 MiB
big.block_until_ready()

def timed(call):
    started = time.perf_counter()
    jax.block_until_ready(call())
    return (time.perf_counter() - started) * 1e3

def median(call):
    return statistics.median(timed(call) for _ in range(rounds))

first_function = cp.colocated_python(lambda x: x + 1)
second_function = cp.colocated_python(lambda x: x * 2)
results = {"first call (executor starts)": timed(lambda: first_function(small))}
results["first call of another function"] = timed(lambda: second_function(small))
results["later calls"] = median(lambda: first_function(small))
specialized = cp.colocated_python(lambda x: x + 1).specialize(out_specs_fn=lambda x: x)
specialized(small).block_until_ready()
results["later calls, specialized"] = median(lambda: specialized(small))
plus_one = jax.jit(lambda x: x + 1)
plus_one(small).block_until_ready()
results["XLA program on the same device"] = median(lambda: plus_one(small))
total = cp.colocated_python(lambda x: x.sum(keepdims=True))
total(big).block_until_ready()
results["64 MiB in, 4 bytes out"] = median(lambda: total(big))
echo = cp.colocated_python(lambda x: x + 1)
echo(big).block_until_ready()
results["64 MiB in, 64 MiB out"] = median(lambda: echo(big))
xla_total = jax.jit(lambda x: x.sum(keepdims=True))
xla_total(big).block_until_ready()
results["64 MiB in, XLA program"] = median(lambda: xla_total(big))
print(json.dumps(results), flush=True)
sys.stdin.readline()  # the executor stays while its memory is measured
"""


def rss_mib(process: psutil.Process) -> float:
    return process.memory_info().rss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="calls timed per later-call row (median)")
    args = parser.parse_args()
    executable = other_users_python()
    with LocalCluster(
        islands=1, devices_per_host=2, colocated_python=True, colocated_python_executable=executable
    ) as cluster:
        worker = psutil.Process(cluster.workers[(0, 0)].process.pid)
        host = psutil.Process(cluster.colocated_hosts[(0, 0)].process.pid)
        worker_before = rss_mib(worker)
        client = python_process(CLIENT, cluster.address, cluster.token, str(args.rounds))
        line = client.stdout.readline()
        if not line:
            raise SystemExit(f"the client failed:\n{client.communicate()[1][-4000:]}")
        latencies = json.loads(line)
        (executor,) = host.children()
        memory = {
            "executor (resident)": rss_mib(executor),
            "executor (unique to it)": executor.memory_full_info().uss / 2**20,
            "colocated host (supervisor)": rss_mib(host),
            "worker, before the session": worker_before,
            "worker, with the session's arrays": rss_mib(worker),
        }
        user = "a user of its own" if executor.uids().real != worker.uids().real else "the cluster's user"
        client.communicate("\n", timeout=120)
    print(f"colocated Python, 1 host of 2 CPU devices, executor as {user}; median of {args.rounds} calls")
    print(f"{'call':40s} {'ms':>10s}")
    for name, value in latencies.items():
        print(f"{name:40s} {value:10.1f}")
    xla = latencies["XLA program on the same device"]
    print(f"{'later call / XLA program':40s} {latencies['later calls'] / xla:9.1f}x")
    print(f"\n{'process':40s} {'MiB':>10s}")
    for name, value in memory.items():
        print(f"{name:40s} {value:10.0f}")


if __name__ == "__main__":
    main()
