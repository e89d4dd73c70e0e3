"""SPMD programs over every device of the cluster at argv[1] (token argv[2]), one island of two hosts in
network namespaces of their own, each compared with the same on 4 local CPU devices.

Prints JSON: for each program whether its result equals local JAX's bitwise (and in dtype), and the
hosts of the devices.
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
x = np.arange(64, dtype=np.float32).reshape(8, 8) % 13


def programs(devices):
    mesh = Mesh(np.array(devices), ("x",))
    rows = NamedSharding(mesh, P("x"))
    a = jax.device_put(x, rows)
    smap = partial(shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    ring = [(i, (i + 1) % 4) for i in range(4)]
    return {
        "put_and_read": a,
        "psum": jax.jit(smap(lambda v: jax.lax.psum(v, "x")))(a),
        "ppermute": jax.jit(smap(lambda v: jax.lax.ppermute(v, "x", ring)))(a),
        "sharded_reduction": jax.jit(lambda v: jnp.sum(v, axis=0) + jnp.max(v))(a),
        "reshard": jax.device_put(a, NamedSharding(mesh, P(None, "x"))),
    }


proxy = jax.devices("proxy")
remote = {k: np.asarray(v) for k, v in programs(proxy).items()}
local = {k: np.asarray(v) for k, v in programs(jax.devices("cpu")).items()}
report = {k: bool(np.array_equal(remote[k], local[k])) and remote[k].dtype == local[k].dtype for k in local}
report["hosts"] = sorted({d.host_index for d in proxy})
print(json.dumps(report))
