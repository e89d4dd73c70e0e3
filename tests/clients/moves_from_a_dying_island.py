"""Moves a long computation's result from island 1 to island 0 of the cluster at argv[1] while the test
kills island 1's worker.

Prints JSON once the move is issued; after a line on stdin, JSON with the moved array's value or the
error its read gave.
"""

import json
import sys

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="mover")
island0, island1 = jax.devices()[0], jax.devices()[2]
busy = jax.jit(lambda x: jax.lax.fori_loop(0, 2_000_000_000, lambda i, v: v * 0.5 + 1.0, x))
source = busy(jax.device_put(np.ones(4, np.float32), island1))
moved = jax.device_put(source, island0)  # island 1 sends it once it is computed
print(json.dumps({"issued": True}), flush=True)
sys.stdin.readline()  # the test kills island 1's worker meanwhile
try:
    print(json.dumps({"value": np.asarray(moved).tolist()}), flush=True)
except Exception as error:  # noqa: BLE001 - the error is what the test checks
    print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
