"""Run by another Python (3.12, with its own jax and numpy): ships a function as its jax's colocated_python
does, for CPU device 1 (which stands for cluster id 1), without running it.

The function, given a float32[3], prints the executor's Python version and numpy version and returns twice
its input. Prints this numpy's version and the serialized function in hex, on one line.
"""

import jax
import numpy as np
from jax import tree_util
from jax._src.lib import xla_client
from jax.experimental.colocated_python import serialization

jax.config.update("jax_num_cpu_devices", 2)


def where(x):
    import sys

    import numpy

    print("executor", sys.version_info.major, sys.version_info.minor, "numpy", numpy.__version__)
    return x * 2


device = jax.devices()[1]
spec = jax.ShapeDtypeStruct((3,), np.float32, sharding=jax.sharding.SingleDeviceSharding(device))
in_leaves, in_tree = tree_util.tree_flatten(((spec,), {}))
out_leaves, out_tree = tree_util.tree_flatten(spec)
devices = xla_client.DeviceList((device,))
text = serialization._serialize((where, in_tree, tuple(in_leaves), out_tree, tuple(out_leaves), devices))
print(np.__version__, text.hex())
