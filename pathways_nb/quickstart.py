"""The quickstart: start a local cluster, run ordinary JAX on it, compare with local JAX.

``python -m pathways_nb.quickstart`` (``make quickstart``) needs no cloud
account: a cluster of two islands of 4 CPU devices each runs on this machine.
"""

from __future__ import annotations

import time

import numpy as np


def main() -> int:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import pathways_nb
    from pathways_nb.cluster import LocalCluster

    with LocalCluster(islands=2, devices_per_host=4) as cluster:
        print(f"cluster: {cluster} (started in {cluster.startup_s:.1f} s)")
        connection = pathways_nb.connect(cluster.address)
        print(f"connected: {connection}")
        print(f"jax.devices(): {jax.devices()}")
        island0 = [d for d in jax.devices() if d.slice_index == 0]
        island1 = [d for d in jax.devices() if d.slice_index == 1]

        mesh = Mesh(np.array(island0).reshape(2, 2), ("data", "model"))
        x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
        print(f"a sharded array: shape {x.shape}, {len(x.addressable_shards)} shards on {x.sharding}")

        @jax.jit
        def step(w, x):
            loss = lambda w: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
            return w - 0.1 * jax.grad(loss)(w), loss(w)

        w = jax.device_put(np.full((8, 4), 0.05, np.float32), NamedSharding(mesh, P("model")))
        t = time.perf_counter()
        for _ in range(20):
            w, loss = step(w, x)
        print(f"20 training steps on the server: loss {float(loss):.4f} ({time.perf_counter() - t:.2f} s)")

        with jax.default_device(jax.devices("cpu")[0]):
            w_local = np.full((8, 4), 0.05, np.float32)
            for _ in range(20):
                w_local, loss_local = step(w_local, np.asarray(x))
        difference = float(np.max(np.abs(np.asarray(w) - np.asarray(w_local))))
        print(f"the same steps on local JAX: loss {float(loss_local):.4f}; largest weight difference {difference:.1e}")

        moved = jax.device_put(w, NamedSharding(Mesh(np.array(island1).reshape(2, 2), ("data", "model")), P("model")))
        print(f"weights moved to island 1 (worker to worker): {sorted(d.id for d in moved.devices())}")
        pathways_nb.disconnect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
