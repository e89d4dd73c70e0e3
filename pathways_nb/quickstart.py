"""The quickstart: start a local Pathways server, run ordinary JAX on it, compare with local JAX.

``python -m pathways_nb.quickstart`` (``make quickstart``) needs no cloud
account: the server runs on this machine with 4 CPU devices.
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
    from pathways_nb.processes import ChildServer

    started = time.monotonic()
    server = ChildServer("proxy", ["proxy", "--server_port", "0", "--devices", "4"])
    server.start()
    try:
        print(f"server: {server.address} (started in {time.monotonic() - started:.1f} s)")
        connection = pathways_nb.connect(server.address)
        print(f"connected: {connection}")
        print(f"jax.devices(): {jax.devices()}")

        mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
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
        pathways_nb.disconnect()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
