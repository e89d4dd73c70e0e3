"""Prints ``started``, then uploads 512 MiB arrays one after another until it is killed.

Run with ``JAX_PLATFORMS=proxy`` and ``JAX_BACKEND_TARGET``: plain JAX, no pathways-nb.
"""

import jax
import numpy as np

print("started", flush=True)
while True:
    jax.device_put(np.ones(512 * 1024 * 1024 // 4, np.float32), jax.devices()[0]).block_until_ready()
