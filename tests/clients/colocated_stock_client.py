"""A stock JAX client, without pathways_nb, calling a colocated function that prints, on the cluster at argv[1].

Run with ``python -S`` and the environment's packages as PYTHONPATH: no ``.pth`` file is read, so nothing
puts pathways_nb on the path. Prints ``RESULT``, the function's result, and whether pathways_nb was imported.
"""

import sys

import jax
import numpy as np
from jax.experimental import colocated_python as cp
from jax.extend.backend import ifrt_proxy, register_backend_factory

register_backend_factory("proxy", lambda: ifrt_proxy.get_client(sys.argv[1], ifrt_proxy.ClientConnectionOptions()))
jax.config.update("jax_platforms", "proxy")
jax.config.update("jax_backend_target", sys.argv[1])
x = jax.device_put(np.ones(2, np.float32), cp.colocated_cpu_devices(jax.devices())[1])


@cp.colocated_python
def loud(x):
    print("a stock client's line")
    return x * 3


print("RESULT", np.asarray(loud(x)).tolist(), "pathways_nb" in sys.modules, flush=True)
