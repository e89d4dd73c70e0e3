"""Fills the session's 32 MiB device quota on the proxy at argv[1], goes over it twice, and goes on.

Prints JSON with the four held arrays' first values; then tries an upload and a program over the
quota; after a line on stdin (the test checks another session meanwhile) deletes two arrays, uploads
again, and prints JSON with both refusals and the new upload's sum.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1])
MIB = 1 << 20
report = {}
held = [jax.device_put(np.full((2 * MIB,), i, np.float32)) for i in range(4)]  # 4 x 8 MiB: at the limit
print(json.dumps({"sums": [float(np.asarray(x)[0]) for x in held]}), flush=True)
over = jax.device_put(np.ones((2 * MIB,), np.float32))
try:
    np.asarray(over)
    report["over"] = "no error"
except jax.errors.JaxRuntimeError as e:
    report["over"] = str(e)
try:
    np.asarray(jax.jit(lambda: jnp.zeros((MIB,), jnp.float32))())
    report["program"] = "no error"
except jax.errors.JaxRuntimeError as e:
    report["program"] = str(e)
sys.stdin.readline()  # the test checks another session meanwhile
for x in held[:2]:
    x.delete()
again = jax.device_put(np.full((2 * MIB,), 7, np.float32))
report["after_delete"] = float(jnp.sum(again[:4]))
print(json.dumps(report), flush=True)
