"""Starts a program that runs for (nearly) ever on the first device of the cluster at argv[1], prints
``reading``, then waits for its result: prints the result, or the error that ended the wait (the test
ends the cluster under it).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1], timeout_s=60, progress=False)
x = jax.device_put(np.ones((256, 256), np.float32), jax.devices()[0])
forever = jax.jit(lambda v: jax.lax.fori_loop(0, 2_000_000_000, lambda i, a: jnp.tanh(a @ v), v).sum())
result = forever(x)
print("reading", flush=True)
try:
    print(float(result))
except Exception as error:  # noqa: BLE001 - the error is what the test checks
    print(f"{type(error).__name__}: {error}", flush=True)
