"""As tenant "spanning", puts an array over every device of the cluster at argv[1] (both islands: a group of them)
and sums it with a program on all of them; prints the sum's first element, then, after a line on stdin (the test
has it preempted meanwhile), the same sum again and whether the array is still the one put there.
"""

import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="spanning")
mesh = Mesh(np.array(jax.devices()), ("x",))
host = np.arange(4 * 256, dtype=np.float32).reshape(4, 256)
total = jax.jit(lambda v: (v * 2).sum(axis=0))
spread = jax.device_put(host, NamedSharding(mesh, PartitionSpec("x")))
print(float(total(spread)[0]), flush=True)
sys.stdin.readline()  # the test has this session preempted, and asks again
print(float(total(spread)[0]), np.array_equal(np.asarray(spread), host), flush=True)
