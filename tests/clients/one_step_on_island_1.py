"""One program on island 1 and its result read back, timed, once told to (a line on stdin).

argv[1]: the proxy's address. Prints ``ready`` once warm, then ``served SECONDS VALUE`` (VALUE: 7.0).
"""

import sys
import time

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="prompt", islands=[1])
step = jax.jit(lambda x: x * 2 + 1)
x = jax.device_put(np.arange(8, dtype=np.float32), jax.devices()[0])
step(x).block_until_ready()
print("ready", flush=True)
sys.stdin.readline()
started = time.perf_counter()
value = float(step(x)[3])  # execute, then read the result back
print("served", time.perf_counter() - started, value, flush=True)
