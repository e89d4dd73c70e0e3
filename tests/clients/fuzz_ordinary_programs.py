"""What a stock client sends for device_put, jit (with donation), sharding and reads, checked.

With no arguments, JAX reaches the server through its environment (``JAX_PLATFORMS=proxy,cpu``,
``JAX_BACKEND_TARGET``); with an address in argv[1], through ``pathways_nb.connect``. Prints ``client
ok``. With ``--warm_profilers`` after the address, then traces every server process once (each loads
its profiler on its first trace, and keeps it) and prints ``profiled``.
"""

import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

if len(sys.argv) > 1:
    import pathways_nb

    pathways_nb.connect(sys.argv[1])
devices = jax.devices()
x = jax.device_put(np.arange(24, dtype=np.float32).reshape(4, 6), devices[0])
y = jax.jit(lambda a: jnp.sin(a) * 2 + a.sum())(x)
mesh = jax.sharding.Mesh(np.array(devices[:2]), ("d",))
s = jax.device_put(np.ones((4, 6), np.int32), NamedSharding(mesh, P("d")))
r = jax.device_put(np.ones((3,), np.float32), NamedSharding(mesh, P()))
shard = np.asarray(s.addressable_shards[1].data)
z = jax.jit(lambda a, b: (a + 1, b.sum()), donate_argnums=0)(s, r)
moved = jax.device_put(y, devices[1])
parts = [np.asarray(v) for v in (y, moved, *z)]
assert shard.tolist() == [[1] * 6] * 2, shard
want = np.sin(np.arange(24, dtype=np.float32).reshape(4, 6)) * 2 + 276
assert np.allclose(parts[0], want) and np.allclose(parts[1], want), parts[0]
assert parts[2].tolist() == [[2] * 6] * 4 and float(parts[3]) == 3.0, parts[2:4]
print("client ok")
if "--warm_profilers" in sys.argv[2:]:
    with tempfile.TemporaryDirectory() as logdir, pathways_nb.profile(logdir, progress=False):
        jax.jit(lambda a: a * 2)(x).block_until_ready()
    print("profiled")
