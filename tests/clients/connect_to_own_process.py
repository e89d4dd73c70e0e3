"""Connects to a proxy served by this very process: refused (jaxlib's client would hold the GIL that
the server needs to answer), and JAX stays local.

Prints the seconds the refusal took and its message, then a local jit's result and platform.
"""

import time

import jax
import numpy as np

import pathways_nb
from pathways_nb.proxy.local_runtime import LocalProxyRuntime
from pathways_nb.proxy.server import ProxyServer
from pathways_nb.worker.runtime import LocalRuntime

server = ProxyServer(LocalProxyRuntime(LocalRuntime("cpu", 1)))
started = time.monotonic()
try:
    pathways_nb.connect(server.address, timeout_s=60)
except pathways_nb.ConnectionFailed as error:
    print(round(time.monotonic() - started, 1), error)
print(jax.jit(lambda x: x + 1)(np.float32(1)), jax.devices()[0].platform)  # JAX is still local
server.stop()
