"""Uploads, downloads and copies between the islands of the cluster at argv[1], bitwise checked.

Arrays of several dtypes, odd sizes and an empty one, on one device and sharded over an island's two
devices, each moved to the other island. Prints JSON: what did not come back equal, how many copies
between islands it made, and its tenant (to find its transfer events).
"""

import json
import sys

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb

connection = pathways_nb.connect(sys.argv[1])
devices = jax.devices()
island0, island1 = devices[:2], devices[2:]
rng = np.random.default_rng(0)
cases = [
    (np.float32, (1 << 20) + 3),
    (np.int8, (3 << 20) + 1),
    (np.uint16, 70001),
    (ml_dtypes.bfloat16, 99999),
    (np.complex64, 40000),
    (np.bool_, 1 << 17),
    (np.int32, 7),
    (np.float32, 0),
]
mismatches, transfers = [], 0


def same(name, got, want):
    got = np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
        mismatches.append(name)


for dtype, size in cases:
    high = 2 if dtype is np.bool_ else 256
    want = rng.integers(0, high, size * np.dtype(dtype).itemsize, np.uint8).view(dtype)
    name = f"{np.dtype(dtype).name}[{size}]"
    on0 = jax.device_put(want, island0[0])
    same(f"{name} up and down", on0, want)
    same(f"{name} island 0 -> island 1", jax.device_put(on0, island1[1]), want)
    transfers += 1
    rows = np.arange(2 * 3 * (size // 6 + 1), dtype=np.int64).astype(dtype).reshape(-1, 3)
    split0 = NamedSharding(Mesh(island0, ("x",)), P("x"))
    split1 = NamedSharding(Mesh(island1, ("x",)), P("x"))
    sharded = jax.device_put(rows, split0)
    same(f"{name} sharded on island 0", sharded, rows)
    same(f"{name} sharded, to island 1", jax.device_put(sharded, split1), rows)
    transfers += 1  # the whole array, from its worker to the other
    halves = [np.asarray(shard.data) for shard in sharded.addressable_shards]
    same(f"{name} shards", np.concatenate(halves), rows)
print(json.dumps({"mismatches": mismatches, "transfers": transfers, "tenant": connection.tenant}))
