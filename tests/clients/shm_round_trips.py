"""Uploads and downloads through the proxy at argv[1], around the shared-memory threshold, bitwise checked.

Arrays of several dtypes and sizes (exactly the threshold, one byte under it, empty, odd shapes over
4 MiB), and one sharded over two devices. Prints JSON: the client's shared directory, threshold and
directory mode as its plugin set them (None where uploads go over gRPC), what is left in the
directory, and the dtypes checked.
"""

import json
import os
import stat
import sys

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import pathways_nb
from pathways_nb.client import jax_plugin
from pathways_nb.core import tuning

pathways_nb.connect(sys.argv[1])
directory = os.environ.get(jax_plugin.DIRECTORY_ENV)
devices = jax.devices("proxy")
rng = np.random.default_rng(0)
threshold = tuning.CLIENT_SHARED_MEMORY_BYTES.value
checked = []
cases = [
    (np.float32, (threshold // 4,)),  # exactly the threshold
    (np.uint8, (threshold - 1,)),  # one byte under it: gRPC
    (np.int8, (0,)),
    (ml_dtypes.bfloat16, (1031, 2053)),  # odd, over 4 MiB: several download messages
    (np.complex64, (3, 700, 301)),
    (np.bool_, (5 * 2**20 + 3,)),
    (np.uint16, (2**19 + 1,)),
]
for dtype, shape in cases:
    host = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    host = host.reshape(shape)
    if dtype == np.bool_:
        host = host.view(np.uint8) % 2 == 1
    on_device = jax.device_put(host, devices[0])
    back = np.asarray(on_device)
    assert back.dtype == host.dtype and back.shape == host.shape
    assert back.tobytes() == host.tobytes(), (dtype, shape)
    checked.append(str(np.dtype(dtype)))
    del on_device
sharded = rng.standard_normal((2048, 1024), dtype=np.float32)
mesh = jax.make_mesh((2,), ("x",), devices=devices[:2])
on_two = jax.device_put(sharded, NamedSharding(mesh, PartitionSpec("x")))
assert np.asarray(on_two).tobytes() == sharded.tobytes()
assert [s.data.shape for s in on_two.addressable_shards] == [(1024, 1024), (1024, 1024)]
print(
    json.dumps(
        {
            "directory": directory,
            "threshold": os.environ.get(jax_plugin.THRESHOLD_ENV),
            "mode": stat.S_IMODE(os.stat(directory).st_mode) if directory else None,
            "left": sorted(os.listdir(directory)) if directory else None,
            "checked": checked,
        }
    )
)
