"""What a client of colocated Python sends: an unspecialized function (three programs, one a string
result), a specialized one, a class's method; the results checked.

With no arguments, JAX reaches the server through its environment (``JAX_PLATFORMS=proxy,cpu``,
``JAX_BACKEND_TARGET``); with an address in argv[1], through ``pathways_nb.connect``. Prints ``client
ok``.
"""

import sys

import jax
import numpy as np
from jax.experimental import colocated_python as cp

if len(sys.argv) > 1:
    import pathways_nb

    pathways_nb.connect(sys.argv[1])
cpus = cp.colocated_cpu_devices(jax.devices())
x = jax.device_put(np.arange(4, dtype=np.float32), cpus[0])
doubled = cp.colocated_python(lambda x: {"y": x * 2})(x)
plus_one = cp.colocated_python(lambda x: x + 1).specialize(out_specs_fn=lambda x: x)(x)


@cp.colocated_python_class
class Total:
    def __init__(self):
        self.total = 0.0

    def add(self, x):
        self.total += float(np.asarray(x).sum())
        return jax.device_put(np.float32(self.total), x.sharding)


total = Total().add(x)
assert np.asarray(doubled["y"]).tolist() == [0, 2, 4, 6], doubled
assert np.asarray(plus_one).tolist() == [1, 2, 3, 4] and float(np.asarray(total)) == 6.0
print("client ok")
