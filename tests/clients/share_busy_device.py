"""Keeps the first device of the cluster at argv[1] (token argv[2]) busy as tenant argv[3] of weight
argv[4], for argv[5] seconds from its start: ~10 ms programs, always some queued.

Prints ``ready``, starts on a line on stdin, and prints ``done N`` once its N programs have run.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb

address, token, tenant = sys.argv[1:4]
weight, seconds = float(sys.argv[4]), float(sys.argv[5])
pathways_nb.connect(address, token=token, tenant=tenant, weight=weight)
device = jax.devices()[0]
step = jax.jit(lambda a: jnp.tanh(a @ a) / 700)  # ~10 ms of device time
x = jax.device_put(np.ones((700, 700), np.float32), device)
outstanding, dispatched, started = [], 0, time.monotonic()
print("ready", flush=True)
sys.stdin.readline()
while time.monotonic() - started < seconds:
    outstanding.append(step(x))  # always some work queued on the island
    dispatched += 1
    if len(outstanding) > 64:
        outstanding.pop(0).block_until_ready()
for y in outstanding:
    y.block_until_ready()
print("done", dispatched, flush=True)
