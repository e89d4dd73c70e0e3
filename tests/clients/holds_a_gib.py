"""Uploads four 256 MiB arrays over two devices, prints ``holding``, and holds them until a line on stdin.

Run with ``JAX_PLATFORMS=proxy`` and ``JAX_BACKEND_TARGET``: plain JAX, no pathways-nb.
"""

import sys

import jax
import numpy as np

arrays = [jax.device_put(np.ones(256 * 1024 * 1024 // 4, np.float32) * i, jax.devices()[i % 2]) for i in range(4)]
jax.block_until_ready(arrays)
print("holding", flush=True)
sys.stdin.readline()
