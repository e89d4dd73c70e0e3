"""Runs one program on a device of every island and compares each result bitwise with this process's own
CPU's (both sides run the same XLA). Connects to argv[1] (an address, or a cluster's address file) where
given; without it, as ``%run`` in a connected kernel, uses the JAX it finds.

Prints JSON: the hosts the devices are on, and for each island whether its result was the same.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

if len(sys.argv) > 1:
    import pathways_nb

    pathways_nb.connect(sys.argv[1], timeout_s=60, progress=False)
program = jax.jit(lambda x: (jnp.tanh(x @ x.T) * 3).sum(axis=0))
x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
local = np.asarray(program(jax.device_put(x, jax.devices("cpu")[0])))
same = {}
for island in sorted({d.slice_index for d in jax.devices()}):
    device = next(d for d in jax.devices() if d.slice_index == island)
    same[island] = np.asarray(program(jax.device_put(x, device))).tobytes() == local.tobytes()
print(json.dumps({"hosts": sorted({d.host.rsplit(":", 1)[0] for d in jax.devices()}), "same": same}))
