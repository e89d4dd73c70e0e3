"""Keeps an array on the first device of the cluster at argv[1] and uses it again after a line on stdin
(the test stalls its worker meanwhile); prints JSON before and after.
"""

import json
import sys

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="patient")
kept = jax.device_put(np.arange(4, dtype=np.float32), jax.devices()[0])
print(json.dumps({"before": np.asarray(kept).tolist()}), flush=True)
sys.stdin.readline()  # the test stalls island 0's worker
print(json.dumps({"after": np.asarray(kept + 1).tolist()}), flush=True)
