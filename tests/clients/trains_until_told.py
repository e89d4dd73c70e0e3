"""Connects to argv[1] as tenant argv[2] with exclusive use of island argv[3] at priority argv[4], and trains a
small linear model step by step until a line arrives on stdin; prints ``training`` once it started, then one
JSON line: its steps, and whether every loss equals the same steps' on this process's own CPU.
"""

import json
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb

address, tenant, island, priority = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pathways_nb.connect(address, tenant=tenant, exclusive=True, islands=[island], priority=priority)
told = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), told.set()), daemon=True).start()

rng = np.random.default_rng(1)
features = rng.standard_normal((256, 32), dtype=np.float32)
targets = features @ rng.standard_normal(32, dtype=np.float32)


def loss(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


@jax.jit
def train_step(w, x, y):
    value, grad = jax.value_and_grad(loss)(w, x, y)
    return w - 0.01 * grad, value


def train(device, steps=None):
    x, y = jax.device_put(features, device), jax.device_put(targets, device)
    w = jax.device_put(np.zeros(32, np.float32), device)
    losses = []
    while (steps is None and not told.is_set()) or (steps is not None and len(losses) < steps):
        w, value = train_step(w, x, y)
        losses.append(float(value))
        if len(losses) == 1:
            print("training", flush=True)
    return losses


remote = train(jax.devices()[0])
local = train(jax.devices("cpu")[0], len(remote))
print(json.dumps({"steps": len(remote), "same_losses": remote == local}), flush=True)
pathways_nb.disconnect()
