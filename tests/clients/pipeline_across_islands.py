"""A two-stage pipeline across the two islands of the cluster at argv[1], microbatch by microbatch.

Prints JSON: the island of the first result, and the largest difference from the same stages on this
process's CPU device.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1])
island0, island1 = jax.devices()[0], jax.devices()[2]
rng = np.random.default_rng(0)
w1, w2 = rng.standard_normal((16, 32), np.float32), rng.standard_normal((32, 4), np.float32)
stage1 = jax.jit(lambda w, x: jnp.tanh(x @ w))
stage2 = jax.jit(lambda w, h: jax.nn.softmax(h @ w))
w1_0, w2_1 = jax.device_put(w1, island0), jax.device_put(w2, island1)
batches = [rng.standard_normal((8, 16), np.float32) for _ in range(6)]
outputs = []
for x in batches:  # microbatches flow through both islands
    h = stage1(w1_0, jax.device_put(x, island0))
    outputs.append(stage2(w2_1, jax.device_put(h, island1)))
got = np.concatenate([np.asarray(o) for o in outputs])
cpu = jax.devices("cpu")[0]
want = np.concatenate(
    [np.asarray(stage2(jax.device_put(w2, cpu), stage1(jax.device_put(w1, cpu), x))) for x in batches]
)
print(
    json.dumps(
        {
            "islands": [o.devices().pop().slice_index for o in outputs[:1]],
            "max_error": float(np.max(np.abs(got - want))),
        }
    )
)
