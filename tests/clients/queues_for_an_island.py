"""Asks for island 1 exclusively as tenant argv[2] and waits its turn (up to 240 s); then runs one program.

argv[1]: the proxy's address. Prints ``served VALUE`` (VALUE: 7.0) once it has the island, then disconnects.
"""

import sys

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant=sys.argv[2], exclusive=True, islands=[1], timeout_s=240, progress=False)
x = jax.device_put(np.arange(8, dtype=np.float32), jax.devices()[0])
print("served", float(jax.jit(lambda a: a * 2 + 1)(x)[3]), flush=True)
pathways_nb.disconnect()
