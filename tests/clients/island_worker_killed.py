"""Computes on both islands of the cluster at argv[1] while the test kills island 1's worker, then restarts it.

Prints a first result from island 1; after a line on stdin (the worker is dead) JSON with island 1's
failure, how long it took, and a result from island 0; after another line (the worker is back) JSON
with a result from island 1 again.
"""

import json
import sys
import time

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1])
island0, island1 = jax.devices()[0], jax.devices()[2]
step = jax.jit(lambda x: x + 1)
a0, a1 = jax.device_put(np.zeros(4, np.float32), island0), jax.device_put(np.zeros(4, np.float32), island1)
print(float(step(a1)[0]), flush=True)
sys.stdin.readline()  # the test kills island 1's worker
started = time.monotonic()
try:
    np.asarray(step(a1))
    failure = None
except Exception as error:  # noqa: BLE001 - the failure is what the test checks
    failure = str(error)
report = {"failure": failure, "seconds": time.monotonic() - started, "island0": float(step(a0)[0])}
print(json.dumps(report), flush=True)
sys.stdin.readline()  # the test restarts it
fresh = jax.device_put(np.full(4, 41, np.float32), island1)
print(json.dumps({"island1": float(step(fresh)[0])}), flush=True)
