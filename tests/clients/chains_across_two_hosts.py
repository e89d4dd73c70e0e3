"""Rounds of 16 chained steps over the two devices of island 0 (one per host), each dispatched as soon as
the last is, as a training loop does; prints JSON with the rounds done and whether the result equals
numpy's. argv: the server's address, its token, the rounds.

The steps split their rows over the hosts and share nothing, so each host runs its part at its own pace.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pathways_nb

pathways_nb.connect(sys.argv[1], token=sys.argv[2] or None)
devices = [d for d in jax.devices() if d.slice_index == 0][:2]
rows = NamedSharding(Mesh(np.array(devices), ("rows",)), PartitionSpec("rows"))
replicated = NamedSharding(rows.mesh, PartitionSpec())
size = 256
w_host = np.random.default_rng(2).random((size, size), dtype=np.float32) / size
w = jax.device_put(w_host, replicated)
step = jax.jit(lambda x, w: jnp.tanh(x @ w) * 0.5 + x * 0.5, out_shardings=rows)
x = jax.device_put(w_host, rows)
expected = w_host
rounds = int(sys.argv[3])
for _ in range(rounds):
    for _ in range(16):
        x = step(x, w)
    x.block_until_ready()
for _ in range(16 * rounds):
    expected = np.tanh(expected @ w_host) * 0.5 + expected * 0.5
print(json.dumps({"rounds": rounds, "equal": bool(np.allclose(np.asarray(x), expected, atol=1e-4))}))
