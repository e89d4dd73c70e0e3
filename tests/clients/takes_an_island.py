"""Connects to argv[1] as tenant argv[2] with exclusive use of island argv[3] at priority argv[4]; prints
``granted SECONDS`` (how long it waited for the devices), checks a computation, and after a line on stdin
disconnects and prints ``released``."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb

address, tenant, island, priority = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
started = time.monotonic()
pathways_nb.connect(address, tenant=tenant, exclusive=True, islands=[island], priority=priority, timeout_s=120)
value = jax.jit(lambda a: jnp.cumsum(a))(jax.device_put(np.arange(10.0, dtype=np.float32), jax.devices()[0]))
assert np.array_equal(np.asarray(value), np.cumsum(np.arange(10.0, dtype=np.float32)))
print(f"granted {time.monotonic() - started:.2f}", flush=True)
sys.stdin.readline()
pathways_nb.disconnect()
print("released", flush=True)
