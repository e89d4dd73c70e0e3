"""Programs of 40 cross-host collectives each on island 1 of the cluster at argv[1] (token argv[2]),
one after another, while the test kills a host of the island.

Prints ``running`` after 20 programs (the test kills the host then); goes on until programs have
failed and then run five times again (90 s at most), and prints JSON: each program's outcome and
seconds.
"""

import json
import sys
import time
from functools import partial

import jax
import numpy as np
from jax.experimental.shard_map import shard_map
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb

pathways_nb.connect(sys.argv[1], token=sys.argv[2])
mesh = Mesh(np.array([d for d in jax.devices("proxy") if d.slice_index == 1]), ("x",))

ring = [(i, (i + 1) % 4) for i in range(4)]


def many_collectives(v):  # one program of 40 cross-host collectives
    return jax.lax.fori_loop(0, 40, lambda _, a: jax.lax.ppermute(a, "x", ring), v)


step = jax.jit(partial(shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(many_collectives))
rows = NamedSharding(mesh, P("x"))
outcomes, started = [], time.monotonic()
while time.monotonic() - started < 90:
    began = time.monotonic()
    try:
        value = float(np.asarray(step(jax.device_put(np.ones((4, 256), np.float32), rows)))[0, 0])
        outcomes.append({"ok": value == 1.0, "s": time.monotonic() - began})
    except Exception as error:  # noqa: BLE001 - the errors are what the test checks
        outcomes.append({"error": str(error)[:300], "s": time.monotonic() - began})
        time.sleep(0.1)  # the interval of its retries while the host is down (the loop is bounded above)
    if len(outcomes) == 20:
        print("running", flush=True)  # the test kills a host of the island now
    failed = [i for i, o in enumerate(outcomes) if "error" in o]
    if failed and len(outcomes) - failed[-1] > 5:
        break  # failed, then served again five times
print(json.dumps(outcomes))
