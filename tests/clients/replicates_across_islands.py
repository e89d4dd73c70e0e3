"""Replicating an array sharded over both islands' devices (an IFRT reshard, as pathwaysutils sends it).

argv[1]: the proxy's address (a cluster of 2 islands of one device each). Prints ``ready`` once the array
is placed; after a line on stdin prints ``asking``, reshards, and prints ``value`` and element 5 (5.0).
"""

import sys

import jax
import numpy as np
import pathwaysutils.reshard
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="slow")
mesh = Mesh(np.array(jax.devices()), ("x",))  # island 0's device and island 1's
a = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("x"))).block_until_ready()
print("ready", flush=True)
sys.stdin.readline()
print("asking", flush=True)
b = pathwaysutils.reshard.reshard(a, NamedSharding(mesh, P()))
print("value", float(np.asarray(b)[5]), flush=True)
