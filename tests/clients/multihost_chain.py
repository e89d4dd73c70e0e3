"""600 psums over island 0 of the cluster at argv[1] (token argv[2]), dispatched back to back as a
training loop does; prints JSON with the final value (1.0).
"""

import json
import sys
from functools import partial

import jax
import numpy as np
from jax.experimental.shard_map import shard_map
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb

pathways_nb.connect(sys.argv[1], token=sys.argv[2])
mesh = Mesh(np.array([d for d in jax.devices() if d.slice_index == 0]), ("x",))
step = jax.jit(partial(shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(lambda v: jax.lax.psum(v, "x") / 4))
x = jax.device_put(np.ones((4, 8), np.float32), NamedSharding(mesh, P("x")))
for _ in range(600):  # dispatched back to back, as a training loop does
    x = step(x)
print(json.dumps({"value": float(np.asarray(x)[0, 0])}))
