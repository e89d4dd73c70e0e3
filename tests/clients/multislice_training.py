"""A Flax + Optax model trained data-parallel across two islands, and the same training on 8 local devices.

The batch is split over a hybrid mesh (dcn 2 x ici 4: each island takes half, its devices a quarter of
that), the parameters are replicated, and XLA averages the gradients over both islands every step.
argv: the proxy's address, the number of steps. Prints one JSON line: both runs' losses, step by step.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)  # the local reference: one process, 8 CPU devices

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.experimental import mesh_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pathways_nb  # noqa: E402


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(1)(x)


def train(mesh: Mesh, steps: int) -> list[float]:
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((64, 8)).astype(np.float32)
    targets = (inputs @ rng.standard_normal((8, 1)).astype(np.float32)).astype(np.float32)
    batch = NamedSharding(mesh, P(("dcn", "ici")))
    replicated = NamedSharding(mesh, P())
    model, optimizer = Model(), optax.adam(1e-2)
    params = jax.device_put(model.init(jax.random.key(0), inputs[:1]), replicated)
    state = jax.device_put(optimizer.init(params), replicated)
    x, y = jax.device_put(inputs, batch), jax.device_put(targets, batch)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    return losses


def main() -> None:
    pathways_nb.connect(sys.argv[1], timeout_s=60, progress=False)
    steps = int(sys.argv[2])
    hybrid = Mesh(mesh_utils.create_hybrid_device_mesh((1, 4), (2, 1), jax.devices()), ("dcn", "ici"))
    remote = train(hybrid, steps)
    local = train(Mesh(np.array(jax.devices("cpu")).reshape(2, 4), ("dcn", "ici")), steps)
    print(json.dumps({"remote": remote, "local": local}), flush=True)


if __name__ == "__main__":
    main()
