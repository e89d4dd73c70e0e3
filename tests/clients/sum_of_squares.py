"""Prints a jit's sum of squares of 0..9 (285.0), how many devices JAX has, and their platform.

Run with ``JAX_PLATFORMS=proxy`` and ``JAX_BACKEND_TARGET``: plain JAX, no pathways-nb.
"""

import jax
import jax.numpy as jnp

x = jnp.arange(10.0)
print(float(jax.jit(lambda v: (v**2).sum())(x)), len(jax.devices()), jax.devices()[0].platform)
