"""A tenant that mixes programs over one island and over both, checking every result.

argv: the proxy's address, the tenant's name, seconds to run, its island (0 or 1). Alternates a sum over
its island's devices and one over every device (its collectives cross islands) with the same inputs,
and prints one JSON line: how many of each ran, and the wrong results (none, if all is well).
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb


def main() -> None:
    address, tenant, seconds, island = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    pathways_nb.connect(address, tenant=tenant, timeout_s=60, progress=False)
    devices = jax.devices()
    mine = [d for d in devices if d.slice_index == island]
    both = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    one = NamedSharding(Mesh(np.array(mine), ("x",)), P("x"))
    total = jax.jit(lambda a: jnp.sum(a * a))
    counts, wrong = {"one island": 0, "two islands": 0}, []
    started, round_ = time.monotonic(), 0
    while time.monotonic() - started < seconds:
        round_ += 1
        for name, sharding, size in (("one island", one, len(mine)), ("two islands", both, len(devices))):
            values = (np.arange(size * 4, dtype=np.float32) + round_) % 7  # whole numbers: exact in any order
            got = float(total(jax.device_put(values, sharding)))
            counts[name] += 1
            if got != float(np.sum(values * values)):
                wrong.append((name, round_, got))
    print(json.dumps({"tenant": tenant, "counts": counts, "wrong": wrong}), flush=True)


if __name__ == "__main__":
    main()
