"""psums over island 0 of the cluster at argv[1] (token argv[2]), as tenant argv[3], for argv[5] seconds;
the values start at argv[4].

Prints JSON: how many rounds ran and how many results were wrong.
"""

import json
import sys
import time
from functools import partial

import jax
import numpy as np
from jax.experimental.shard_map import shard_map
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb

pathways_nb.connect(sys.argv[1], token=sys.argv[2], tenant=sys.argv[3])
island = [d for d in jax.devices("proxy") if d.slice_index == 0]
mesh = Mesh(np.array(island), ("x",))
seed = int(sys.argv[4])
psum = jax.jit(partial(shard_map, mesh=mesh, in_specs=P("x"), out_specs=P())(lambda v: jax.lax.psum(v, "x")))
started, rounds, wrong = time.monotonic(), 0, 0
while time.monotonic() - started < float(sys.argv[5]):
    x = np.full((4, 3), seed + rounds, np.float32)
    wrong += not np.array_equal(
        np.asarray(psum(jax.device_put(x, NamedSharding(mesh, P("x"))))),
        np.full((1, 3), 4 * (seed + rounds), np.float32),
    )
    rounds += 1
print(json.dumps({"rounds": rounds, "wrong": wrong}))
