"""Connects to argv[1] and runs a jit on the first device of each island listed in argv[2] (``0,1``).

Prints JSON: how many devices the cluster has, and each island's result (140.0 each).
"""

import json
import sys

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1], timeout_s=60, progress=False)
results = {}
for island in map(int, sys.argv[2].split(",")):
    device = next(d for d in jax.devices() if d.slice_index == island)
    x = jax.device_put(np.arange(8, dtype=np.float32), device)
    results[island] = float(jax.jit(lambda v: (v * v).sum())(x))
print(json.dumps({"devices": len(jax.devices()), "results": results}))
pathways_nb.disconnect()
