"""Local JAX, then the proxy at argv[1], local again, and the proxy again, in one process.

Prints, per phase, where a jit ran (``local``/``remote``), its result and the backend's runtime type
(and, the first time on the proxy, how many devices it has).
"""

import sys

import jax
import numpy as np

import pathways_nb

f = jax.jit(lambda x: x * 2)
print("local", float(f(np.float32(1))), jax.devices()[0].client.runtime_type)
pathways_nb.connect(sys.argv[1])
print("remote", float(f(np.float32(2))), jax.devices()[0].client.runtime_type, len(jax.devices()))
pathways_nb.disconnect()
print("local", float(f(np.float32(3))), jax.devices()[0].client.runtime_type)
pathways_nb.connect(sys.argv[1])
print("remote", float(f(np.float32(4))), jax.devices()[0].client.runtime_type)
