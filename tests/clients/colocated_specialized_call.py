"""A colocated function specialized with its output specs, called three times asynchronously.

Says the three results and the devices of the first.
"""

import jax
import numpy as np
from colocated_client import connect, say
from jax.experimental import colocated_python as cp

cpus = connect()


def scaled(x, factor):
    return x * factor


call = cp.colocated_python(scaled).specialize(out_specs_fn=lambda x, factor: x)
x = jax.device_put(np.ones((2, 3), np.float32), cpus[2])
f = jax.device_put(np.float32(3), cpus[2])
outs = [call(x, f) for _ in range(3)]  # asynchronous: results are futures
say(values=[np.asarray(o).tolist() for o in outs], devices=[d.id for d in outs[0].devices()])
