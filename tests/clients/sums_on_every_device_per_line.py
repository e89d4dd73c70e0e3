"""Connects to argv[1] as tenant ``steady``; for each line on stdin, puts an array on every device,
runs a jit on each, and prints JSON with their sums (the first line it prints says it is ready).
"""

import json
import sys

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="steady")
step = jax.jit(lambda x: x * 2)
print(json.dumps({"ready": True}), flush=True)
for _line in sys.stdin:
    arrays = [jax.device_put(np.full(4, i, np.float32), d) for i, d in enumerate(jax.devices())]
    print(json.dumps({"sums": [float(step(a).sum()) for a in arrays]}), flush=True)
