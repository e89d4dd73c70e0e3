"""A long program on island 0's devices (all of its hosts), and meanwhile uploads, reads and small
programs: prints JSON with how long each took against how long the long program ran.

argv: the server's address, its token ("" for none), how many of island 0's devices the long program
spans. The uploads and reads go to the first of those devices (a device that computes still takes
transfers); the small programs run on another device of the session when there is one.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pathways_nb

pathways_nb.connect(sys.argv[1], token=sys.argv[2] or None)
island = [d for d in jax.devices() if d.slice_index == 0]
spans = island[: int(sys.argv[3])]
others = [d for d in jax.devices() if d not in spans]
rows = NamedSharding(Mesh(np.array(spans), ("rows",)), PartitionSpec("rows"))


@jax.jit
def long(x):
    return jax.lax.fori_loop(0, 40, lambda _, v: jnp.tanh(v @ v.T) * 0.5 + v * 0.5, x)


host = np.random.default_rng(0).random((512, 512), dtype=np.float32) / 64
x = jax.device_put(host, rows)
iterations = 40
started = time.perf_counter()
long(x).block_until_ready()  # compiled, and timed once alone
alone_s = time.perf_counter() - started
while alone_s < 1.5:  # long enough that what follows could not hide inside the dispatch
    iterations *= 2
    long = jax.jit(lambda x, n=iterations: jax.lax.fori_loop(0, n, lambda _, v: jnp.tanh(v @ v.T) * 0.5 + v * 0.5, x))
    started = time.perf_counter()
    long(x).block_until_ready()
    alone_s = time.perf_counter() - started

small = jax.jit(lambda v: v * 2 + 1)
if others:
    small(jax.device_put(np.ones(4, np.float32), others[0])).block_until_ready()
started = time.perf_counter()
result = long(x)
dispatched_s = time.perf_counter() - started
side = []
for i in range(10):
    began = time.perf_counter()
    value = np.full(256, i, np.float32)
    assert (np.asarray(jax.device_put(value, spans[0])) == value).all()
    if others:
        assert (np.asarray(small(jax.device_put(value, others[0]))) == value * 2 + 1).all()
    side.append(time.perf_counter() - began)
side_done_s = time.perf_counter() - started
result.block_until_ready()
long_s = time.perf_counter() - started
print(
    json.dumps(
        {
            "alone_s": alone_s,
            "dispatched_s": dispatched_s,
            "side_done_s": side_done_s,
            "side_max_s": max(side),
            "long_s": long_s,
            "small_programs": bool(others),
            "hosts": sorted({d.host_index for d in spans}),
        }
    )
)
