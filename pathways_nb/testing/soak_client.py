"""A soak client (``pathways_nb.testing.soak``): connects to the cluster at argv[1] as tenant ``soak-SEED`` and loops
over a fixed set of workloads (uploads, programs on one device and sharded over an island, copies between islands),
each checked against the same work on its own CPU devices, disconnecting and connecting again now and then.

argv[2], seconds: > 0 works that long; 0 runs every workload once (the warm-up); < 0 works until killed, printing
``{"progress": N}`` after each finished workload. argv[3]: the seed; argv[4]: the cluster's token. Prints its report
as JSON at the end: iterations, wrong results (and which work), errors, connects.
"""

import itertools
import json
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb

address, seconds, seed, token = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.config.update("jax_num_cpu_devices", 4)  # local twins of an island's devices, for the checks
rng = random.Random(seed)
cpu = jax.devices("cpu")
PROGRAMS = [
    jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0)),
    jax.jit(lambda x: (x * 3 + 1).astype(jnp.float32)),
    jax.jit(lambda x: jnp.cumsum(x, axis=-1)),
]
SHAPES = [(8, 8), (128, 64)]
DTYPES = [np.float32, np.float16]
KINDS = ["upload", "program", "sharded", "between islands"]


def same(remote, local):
    remote, local = np.asarray(remote), np.asarray(local)
    return remote.dtype == local.dtype and remote.shape == local.shape and np.array_equal(remote, local)


def work(kind, shape, dtype, program, island, islands):
    x = (np.random.default_rng(rng.randrange(1 << 30)).standard_normal(shape) * 4).astype(dtype)
    device = islands[island][0]
    if kind == "upload":
        return same(jax.device_put(x, device), x)
    if kind == "program":
        return same(program(jax.device_put(x, device)), program(jax.device_put(x, cpu[0])))
    if kind == "sharded":
        size = len(islands[island])
        sharded = jax.device_put(x, NamedSharding(Mesh(np.array(islands[island]), ("x",)), P("x")))
        local = jax.device_put(x, NamedSharding(Mesh(np.array(cpu[:size]), ("x",)), P("x")))
        return same(program(sharded), program(local))
    other = islands[(island + 1) % len(islands)][-1]
    return same(jax.device_put(jax.device_put(x, device), other), x)


def everything(islands):
    # Every combination once: after a warm-up that ran it, nothing new is compiled.
    return itertools.product(KINDS, SHAPES, DTYPES, PROGRAMS, sorted(islands))


def describe(combo):
    kind, shape, dtype, program, island = combo
    return f"{kind} {shape} {np.dtype(dtype).name} program {PROGRAMS.index(program)} island {island}"


report = {"seed": seed, "iterations": 0, "wrong": 0, "wrong_work": [], "errors": [], "connects": 0}
started = time.monotonic()
while True:
    pathways_nb.connect(address, tenant=f"soak-{seed}", token=token or None, progress=False)
    report["connects"] += 1
    islands = {}
    for d in jax.devices("proxy"):
        islands.setdefault(d.island, []).append(d)
    combos = list(everything(islands))
    chosen = combos if seconds == 0 else [rng.choice(combos) for _ in range(rng.randrange(20, 60))]
    for combo in chosen:
        try:
            if not work(*combo, islands):
                report["wrong"] += 1
                report["wrong_work"].append(describe(combo))
        except Exception as error:  # noqa: BLE001 - every failure is reported, and the soak goes on
            report["errors"].append(f"{describe(combo)}: {type(error).__name__}: {str(error)[:300]}")
        report["iterations"] += 1
        if seconds < 0:
            print(json.dumps({"progress": report["iterations"]}), flush=True)
        if time.monotonic() - started >= seconds > 0:
            break
    pathways_nb.disconnect()
    if 0 <= seconds <= time.monotonic() - started:
        break
print(json.dumps(report), flush=True)
