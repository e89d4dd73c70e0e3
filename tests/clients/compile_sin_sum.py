"""Connects to argv[1] and prints the result of a jit of ``sin(x).sum() * 2`` over eight ones.

The test sets XLA dump flags in this client's environment, which must not reach the server.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1])
print(float(jax.jit(lambda x: jnp.sin(x).sum() * 2)(jax.device_put(np.ones(8, np.float32)))))
