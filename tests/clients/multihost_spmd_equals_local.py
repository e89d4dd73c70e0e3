"""SPMD programs over island 0 of the cluster at argv[1] (token argv[2]), an island of two hosts, and a
pipeline from island 0 to island 1, each compared with the same on 4 local CPU devices.

Prints JSON: for each program whether its result equals local JAX's bitwise (and in dtype), and the
hosts of island 0.
"""

import json
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.shard_map import shard_map
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb

jax.config.update("jax_num_cpu_devices", 4)
pathways_nb.connect(sys.argv[1], token=sys.argv[2])
island0 = [d for d in jax.devices("proxy") if d.slice_index == 0]
island1 = [d for d in jax.devices("proxy") if d.slice_index == 1]
x = np.arange(64, dtype=np.float32).reshape(8, 8) % 13


def programs(devices):
    mesh = Mesh(np.array(devices), ("x",))
    grid = Mesh(np.array(devices).reshape(2, 2), ("x", "y"))
    rows = NamedSharding(mesh, P("x"))
    a = jax.device_put(x, rows)
    ring = [(i, (i + 1) % 4) for i in range(4)]
    smap = partial(shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    w = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(grid, P(None, "y")))

    def loss(w, batch):
        return jnp.sum((batch @ w) ** 2)

    return {
        "put_and_read": a,
        "sum_across_hosts": jax.jit(lambda v: jnp.sum(v) + v)(a),
        "psum": jax.jit(smap(lambda v: jax.lax.psum(v, "x")))(a),
        "all_gather": jax.jit(smap(lambda v: jax.lax.all_gather(v, "x", tiled=True)[:2] * 2))(a),
        "ppermute": jax.jit(smap(lambda v: jax.lax.ppermute(v, "x", ring)))(a),
        "matmul_2d": jax.jit(lambda v, m: v @ m)(jax.device_put(x, NamedSharding(grid, P("x", None))), w),
        "reshard": jax.device_put(a, NamedSharding(mesh, P(None, "x"))),
        "grad_step": jax.jit(lambda w, b: w - 0.01 * jax.grad(loss)(w, b))(w, jax.device_put(x, rows)),
        "to_one_device": jax.device_put(a, devices[3]),
        "replicated_scalar": jax.device_put(np.float32(3.5), NamedSharding(mesh, P())) * 2,
    }


remote = {k: np.asarray(v) for k, v in programs(island0).items()}
local = {k: np.asarray(v) for k, v in programs(jax.devices("cpu")).items()}
report = {k: bool(np.array_equal(remote[k], local[k])) and remote[k].dtype == local[k].dtype for k in local}
# A pipeline across two islands of two hosts each: stage 1 on island 0, stage 2 on island 1.
stage1 = jax.jit(lambda v: jnp.tanh(v / 13) * 13)
stage2 = jax.jit(lambda v: jnp.round(v).sum(axis=1))
rows1 = NamedSharding(Mesh(np.array(island1), ("x",)), P("x"))
h = stage1(jax.device_put(x, NamedSharding(Mesh(np.array(island0), ("x",)), P("x"))))
got = np.asarray(stage2(jax.device_put(h, rows1)))
want = np.asarray(stage2(stage1(jax.device_put(x, jax.devices("cpu")[0]))))
report["pipeline_across_islands"] = bool(np.array_equal(got, want))
report["hosts"] = sorted({d.host_index for d in island0})
print(json.dumps(report))
