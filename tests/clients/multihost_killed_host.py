"""A program over island 1 of the cluster at argv[1] (token argv[2]) while the test kills one of its hosts.

Prints JSON with the program's result; after a line on stdin (the host is dead), JSON with what the
program gave on island 1 and on island 0; after another line (both hosts replaced), JSON with its
result on island 1, retried until the proxy has heard of them (60 s at most).
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb
from pathways_nb.testing import wait_until

pathways_nb.connect(sys.argv[1], token=sys.argv[2])
island1 = [d for d in jax.devices("proxy") if d.slice_index == 1]
island0 = [d for d in jax.devices("proxy") if d.slice_index == 0]
total = jax.jit(lambda v: jnp.sum(v))


def attempt(devices):
    rows = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    try:
        return {"value": float(total(jax.device_put(np.ones((4, 2), np.float32), rows)))}
    except Exception as error:  # noqa: BLE001 - the error is what the test checks
        return {"error": str(error)[:400]}


print(json.dumps(attempt(island1)), flush=True)
sys.stdin.readline()  # the test kills island 1's host 1
print(json.dumps({"island1": attempt(island1), "island0": attempt(island0)}), flush=True)
sys.stdin.readline()  # the resource manager shows the island formed again
try:  # the proxy hears of it within its watch's next update
    result = wait_until(
        lambda: attempt(island1), 60, "island 1 serving again", holds=lambda r: "value" in r, interval_s=0.25
    )
except TimeoutError as error:
    result = {"error": str(error)}
print(json.dumps(result), flush=True)
