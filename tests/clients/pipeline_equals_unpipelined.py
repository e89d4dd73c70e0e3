"""GPipe and 1F1B steps of ``pathways_nb.pipeline`` over 2 and 4 stages, one stage per device, against the same
MLP's unpipelined step on one CPU device of this process.

argv[1]: a cluster's address (its first 4 devices, one per island on a cluster of 4 islands of one device),
or ``local`` (this process's 4 CPU devices). Prints JSON: for each ``<schedule>-<stages>``, the largest
difference in the loss and in any gradient, the devices each stage's gradients live on, and the most
residuals each stage held.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb
from pathways_nb.pipeline import Pipeline

if sys.argv[1] == "local":
    jax.config.update("jax_num_cpu_devices", 4)
    devices = jax.devices()
else:
    pathways_nb.connect(sys.argv[1])
    devices = jax.devices()[:4]
cpu = jax.devices("cpu")[0]


def layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def loss(p, x, targets):
    return jnp.mean((x @ p["w"] - targets) ** 2)


def unpipelined(params, x, targets):
    for p in params[:-1]:
        x = layer(p, x)
    return loss(params[-1], x, targets)


rng = np.random.default_rng(0)
x, targets = rng.standard_normal((32, 16), np.float32), rng.standard_normal((32, 4), np.float32)
report = {}
for stages in (2, 4):
    params = [
        {"w": rng.standard_normal((16, 16), np.float32) / 4, "b": rng.standard_normal(16, np.float32) / 4}
        for _ in range(stages - 1)
    ] + [{"w": rng.standard_normal((16, 4), np.float32) / 4}]
    want_loss, want_grads = jax.jit(jax.value_and_grad(unpipelined))(jax.device_put(params, cpu), x, targets)
    for schedule in ("gpipe", "1f1b"):
        pipe = Pipeline([layer] * (stages - 1) + [loss], devices[:stages], microbatches=8, schedule=schedule)
        for _ in range(2):  # the second step runs the programs the first compiled
            result = pipe.step(params, x, targets)
        grads = jax.tree.leaves(result.grads)
        report[f"{schedule}-{stages}"] = {
            "loss_error": abs(float(result.loss) - float(want_loss)),
            "grad_error": max(
                float(np.max(np.abs(np.asarray(g) - np.asarray(w))))
                for g, w in zip(grads, jax.tree.leaves(want_grads), strict=True)
            ),
            "devices": [sorted(d.id for d in jax.tree.leaves(g)[0].devices()) for g in result.grads],
            "expected_devices": [[d.id] for d in devices[:stages]],
            "peak_live": result.peak_live,
        }
print(json.dumps(report))
