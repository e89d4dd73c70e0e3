"""Keeps an island of two hosts (the cluster at argv[1], token argv[2]) busy as tenant argv[3] of weight
argv[4], for argv[5] seconds from its start, with SPMD programs over both hosts' devices: argv[6] says which
(``all-gather``: a cross-host collective; ``no collective``: each host computes its rows alone;
``no collective, host 1 slower``: host 1 does twice the work). It sends them in batches of 8, each once
the one before has run, as a training loop that reads its loss every 8 steps: after every batch the
tenant has nothing queued on the island while its client's wait returns and the next batch arrives.

Prints ``ready``, starts on a line on stdin, and prints ``done N`` once its N programs have run.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb

address, token, tenant = sys.argv[1:4]
weight, seconds, program = float(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
pathways_nb.connect(address, token=token, tenant=tenant, weight=weight)
mesh = Mesh(np.array(jax.devices()), ("x",))  # both hosts' devices
rows, replicated = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
if program == "all-gather":
    step = jax.jit(lambda a, w: jnp.tanh(a @ a.T) / 600, out_shardings=rows)  # a cross-host all-gather
    x, w = jax.device_put(np.ones((600, 600), np.float32), rows), None
else:  # each host its rows, alone
    x = jax.device_put(np.ones((640, 640), np.float32), rows)
    w = jax.device_put(np.eye(640, dtype=np.float32) / 2, replicated)
    step = jax.jit(lambda a, w: jnp.tanh(a @ w @ w @ w), out_shardings=rows)
if program == "no collective, host 1 slower":  # twice the work on host 1

    def part(a, w):
        y = jnp.tanh(a @ w @ w @ w)
        return jax.lax.cond(jax.lax.axis_index("x") == 1, lambda y: jnp.tanh(y @ w @ w @ w), lambda y: y, y)

    step = jax.jit(jax.shard_map(part, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
dispatched, started = 0, time.monotonic()
print("ready", flush=True)
sys.stdin.readline()
while time.monotonic() - started < seconds:
    batch = [step(x, w) for _ in range(8)]
    batch[-1].block_until_ready()  # a tenant's steps end in order: the batch has run
    dispatched += len(batch)
print("done", dispatched, flush=True)
