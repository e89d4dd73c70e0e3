"""Connects to argv[1] (token argv[2]), compiles ``v * argv[3]`` and keeps it; prints its result, and
again for each line on stdin.
"""

import sys

import jax
import numpy as np

import pathways_nb

address, token, factor = sys.argv[1], sys.argv[2], float(sys.argv[3])
pathways_nb.connect(address, token=token)
x = jax.device_put(np.arange(4, dtype=np.float32), jax.devices()[0])
kept = jax.jit(lambda v: v * factor).lower(x).compile()
print(np.asarray(kept(x)).tolist(), flush=True)
for _line in iter(sys.stdin.readline, ""):
    print(np.asarray(kept(x)).tolist(), flush=True)
