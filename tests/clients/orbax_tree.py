"""What the Orbax client scripts share (imported by them, not run): Orbax as the process runs it, and
the tree every test saves.

A client of a cluster runs as a Pathways on Cloud training script does (``JAX_PLATFORMS=proxy``,
``ENABLE_PATHWAYS_PERSISTENCE=1``): pathwaysutils is initialized before Orbax is imported. In plain
local JAX (``JAX_PLATFORMS=cpu``, 4 devices) Orbax is stock, and no pathways-nb is imported.

The tree: bfloat16, float32 and int32 arrays in three shardings over 4 devices (2 islands x 2), and a
PRNG key; made on the devices, so that the client holds none of it.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

if os.environ.get("ENABLE_PATHWAYS_PERSISTENCE") == "1":
    import pathwaysutils

    pathwaysutils.initialize()
import orbax.checkpoint as ocp  # after pathwaysutils' set-up

__all__ = ["host_values", "make", "ocp", "same", "tree"]


def make(mesh, shape, spec, values):
    """An array of ``values(flat index)``, each device computing its own shard (no program spans islands)."""
    sharding = NamedSharding(mesh, spec)

    def shard(index, device):
        ranges = [range(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]

        def compute():
            grids = jnp.meshgrid(*[jnp.arange(r.start, r.stop) for r in ranges], indexing="ij")
            return values(sum(g * int(np.prod(shape[k + 1 :])) for k, g in enumerate(grids)))

        return jax.jit(compute, out_shardings=SingleDeviceSharding(device))()

    indices = sharding.devices_indices_map(shape)
    return jax.make_array_from_single_device_arrays(shape, sharding, [shard(indices[d], d) for d in indices])


def tree(devices):
    """The tree, on ``devices`` (4 of them, a 2 x 2 mesh)."""
    mesh = Mesh(np.array(devices).reshape(2, 2), ("islands", "devices"))
    return {
        "w": make(mesh, (1024, 512), P("islands", "devices"), lambda i: jnp.sin(i * 0.01).astype(jnp.bfloat16)),
        "b": make(mesh, (512, 256), P(None, "devices"), lambda i: jnp.cos(i * 0.5).astype(jnp.float32)),
        "steps": make(mesh, (64, 64), P(), lambda i: (i * 7).astype(jnp.int32)),
        "key": jax.device_put(jax.random.key(7), NamedSharding(mesh, P())),
    }


def host_values(tree):
    """The tree's values as numpy arrays (a key as its key data)."""
    return {k: np.asarray(jax.random.key_data(v) if k == "key" else v) for k, v in tree.items()}


def same(restored, expected, expected_dtypes):
    """For each array of ``expected`` (host values), whether ``restored`` has it bitwise, in its dtype."""
    return {
        k: bool(np.array_equal(host_values(restored)[k], expected[k]))
        and str(restored[k].dtype) == str(expected_dtypes[k])
        for k in expected
    }
