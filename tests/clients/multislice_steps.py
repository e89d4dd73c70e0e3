"""Steps over the devices of some islands, one a line, until its standard input closes: what a test kills under.

argv: the proxy's address, the tenant's name, the islands to use ("0,1": a program across both). Each step
runs one program over those islands' devices and reads its result; the client prints a JSON line per
step: {"at": time.time() when it began, "ok": true} or {"at": ..., "error": "CODE: message"}. It prints
"ready" first, once the program has run once.
"""

from __future__ import annotations

import json
import select
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb


def main() -> None:
    address, tenant, islands = sys.argv[1], sys.argv[2], {int(i) for i in sys.argv[3].split(",")}
    pathways_nb.connect(address, tenant=tenant, timeout_s=60, progress=False)
    devices = [d for d in jax.devices() if d.slice_index in islands]
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    values = np.arange(len(devices) * 2, dtype=np.float32) % 5
    expected = float(np.sum(values))
    total = jax.jit(jnp.sum)
    assert float(total(jax.device_put(values, sharding))) == expected
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:  # until the test closes our input
        report = {"at": time.time()}
        try:
            got = float(total(jax.device_put(values, sharding)))
            report["ok"] = got == expected
        except jax.errors.JaxRuntimeError as error:
            report["error"] = str(error).splitlines()[0][:500]
            time.sleep(0.2)
        print(json.dumps(report), flush=True)
        time.sleep(0.02)


if __name__ == "__main__":
    main()
