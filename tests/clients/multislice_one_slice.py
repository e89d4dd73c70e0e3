"""Each island a slice by default; one slice for all when asked, so that ``jax.make_mesh`` spans islands.

argv: the proxy's address, then ``connect`` (``pathways_nb.connect``: first as it comes, then with
``one_slice=True``) or ``plain`` (a ``JAX_PLATFORMS=proxy`` program, which the test gives
``PATHWAYS_ONE_SLICE=1``). Prints one JSON line: the name of each check and whether it held.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)  # the local reference: one process, 8 CPU devices

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pathways_nb  # noqa: E402

address, mode = sys.argv[1], sys.argv[2]
x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6) % 13  # whole numbers: sums exact in any order


def one_program(devices) -> np.ndarray:
    """A sum over a ``jax.make_mesh`` of all 8 devices (its reduction crosses islands)."""
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    rows = jax.device_put(x, NamedSharding(mesh, P("x")))
    return np.asarray(jax.jit(lambda a: (a * a).sum(axis=0), out_shardings=NamedSharding(mesh, P()))(rows))


checks = {}
local = one_program(jax.devices("cpu"))
if mode == "connect":
    pathways_nb.connect(address)
    devices = jax.devices()
    checks["a slice per island"] = [d.slice_index for d in devices] == [0] * 4 + [1] * 4
    try:
        one_program(devices)
        checks["jax.make_mesh refuses two slices"] = False
    except ValueError as error:
        checks["jax.make_mesh refuses two slices"] = "create_hybrid_device_mesh" in str(error)
    pathways_nb.disconnect()
    pathways_nb.connect(address, one_slice=True)
devices = jax.devices("proxy")
checks["one slice"] = {d.slice_index for d in devices} == {0}
checks["islands still named"] = [d.island for d in devices] == [0] * 4 + [1] * 4
checks["repr as one slice"] = repr(devices[0]) == "CpuDevice(id=0)"
checks["make_mesh over both islands equals local"] = np.array_equal(one_program(devices), local)
print(json.dumps(checks))
