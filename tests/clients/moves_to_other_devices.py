"""Connects to argv[1] as tenant argv[2] with exclusive use of argv[3] devices on any island, keeps arrays (one
sharded over its devices, int8 and bfloat16 ones on one device, one computed) and a compiled program, and prints
``ready``; after a line on stdin (its session was suspended and its devices taken meanwhile: it resumes on others
of the same shape) uses them all again, compiles a new program, and prints what it found as JSON."""

import json
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pathways_nb

address, tenant, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
pathways_nb.connect(address, tenant=tenant, exclusive=True, num_devices=count)
devices = jax.devices()
described = [(d.id, d.platform, d.device_kind) for d in devices]
rng = np.random.default_rng(7)
mesh = Mesh(np.array(devices), ("x",))
wide_host = rng.standard_normal((8 * count, 256), dtype=np.float32)
wide = jax.device_put(wide_host, NamedSharding(mesh, PartitionSpec("x")))
small_host = rng.integers(-128, 127, 4096, dtype=np.int8)
small = jax.device_put(small_host, devices[-1])
half_host = rng.standard_normal(1024).astype(ml_dtypes.bfloat16)
half = jax.device_put(half_host, devices[0])
step = jax.jit(lambda a: jnp.tanh(a) * 2 + 1)
stepped = step(wide)
stepped_host = np.asarray(stepped)
print("ready", flush=True)
sys.stdin.readline()
found = {
    "wide_equal": np.array_equal(np.asarray(wide), wide_host),
    "small_equal": np.array_equal(np.asarray(small), small_host),
    "half_equal": np.array_equal(np.asarray(half).view(np.uint16), half_host.view(np.uint16)),
    "stepped_equal": np.array_equal(np.asarray(stepped), stepped_host),
    "step_again_equal": np.array_equal(np.asarray(step(wide)), stepped_host),
    "new_program_close": np.allclose(
        np.asarray(
            jax.jit(lambda a, b: a.sum(axis=0) + b[:256].astype(jnp.float32))(
                wide, jax.device_put(small, NamedSharding(mesh, PartitionSpec()))
            )
        ),
        wide_host.sum(axis=0) + small_host[:256].astype(np.float32),
        rtol=1e-5,
    ),
    "devices_same": [(d.id, d.platform, d.device_kind) for d in jax.devices()] == described,
    "sharding_same": wide.sharding == NamedSharding(mesh, PartitionSpec("x")),
}
print(json.dumps(found), flush=True)
sys.stdin.readline()
pathways_nb.disconnect()
