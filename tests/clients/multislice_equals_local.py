"""Programs over a hybrid mesh of two islands (dcn 2 x ici N, N each island's devices) give what local JAX gives
on 2N devices, bit for bit.

Also moves arrays between the host, one island and both, and reads a program's outputs sharded across
islands. argv: the proxy's address, and the cluster token where this process cannot find it. Prints one JSON
line: the name of each check and whether it held.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)  # the local reference: one process, up to 8 CPU devices

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import mesh_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pathways_nb  # noqa: E402


def programs(mesh: Mesh) -> dict[str, np.ndarray]:
    """Collectives over both axes, over the slow one alone, and a point-to-point exchange across it."""
    rows = NamedSharding(mesh, P(("dcn", "ici")))
    # Whole numbers: sums are exact in any order (a reduction across hosts adds in another order than one
    # process does, which for other floats may differ in the last bits).
    x = jax.device_put(np.arange(8 * 6, dtype=np.float32).reshape(8, 6) % 13, rows)
    results = {
        "jit sum": jax.jit(lambda a: jnp.sum(a * a, axis=0))(x),
        "psum over both axes": jax.jit(
            jax.shard_map(
                lambda b: jax.lax.psum(b, ("dcn", "ici")), mesh=mesh, in_specs=P(("dcn", "ici")), out_specs=P()
            )
        )(x),
        "all-gather over dcn": jax.jit(
            jax.shard_map(
                lambda b: jax.lax.all_gather(b, "dcn", tiled=True),
                mesh=mesh,
                in_specs=P("dcn", None),
                out_specs=P(),
                check_vma=False,
            )
        )(x),
        "ppermute across islands": jax.jit(
            jax.shard_map(
                lambda b: jax.lax.ppermute(b, "dcn", [(0, 1), (1, 0)]),
                mesh=mesh,
                in_specs=P(("dcn", "ici")),
                out_specs=P(("dcn", "ici")),
            )
        )(x),
    }
    return {name: np.asarray(value) for name, value in results.items()}


def main() -> None:
    pathways_nb.connect(sys.argv[1], timeout_s=60, progress=False, token=sys.argv[2] if len(sys.argv) > 2 else None)
    remote_devices = jax.devices()
    assert sorted({d.slice_index for d in remote_devices}) == [0, 1], remote_devices
    per_island = len(remote_devices) // 2
    local_devices = jax.devices("cpu")[: 2 * per_island]
    hybrid = Mesh(mesh_utils.create_hybrid_device_mesh((1, per_island), (2, 1), remote_devices), ("dcn", "ici"))
    local = Mesh(np.array(local_devices).reshape(2, per_island), ("dcn", "ici"))
    checks = {}
    remote_results, local_results = programs(hybrid), programs(local)
    for name, value in remote_results.items():
        want = local_results[name]
        checks[name] = value.dtype == want.dtype and value.shape == want.shape and np.array_equal(value, want)

    host = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    both = NamedSharding(hybrid, P(("dcn", "ici")))
    island0 = NamedSharding(Mesh(np.array(remote_devices[:per_island]), ("x",)), P("x"))
    on_both = jax.device_put(host, both)
    checks["host to two islands and back"] = np.array_equal(np.asarray(on_both), host)
    on_one = jax.device_put(on_both, island0)
    checks["two islands to one and back"] = np.array_equal(np.asarray(jax.device_put(on_one, both)), host)
    checks["one island to two islands"] = np.array_equal(
        np.asarray(jax.device_put(jax.device_put(host, island0), both)), host
    )
    doubled = jax.jit(lambda a: a * 2, out_shardings=both)(jax.device_put(on_one, both))
    checks["outputs sharded across islands"] = doubled.sharding == both and np.array_equal(
        np.asarray(doubled), host * 2
    )
    last = doubled.addressable_shards[-1]  # on island 1
    checks["a shard of it, read"] = np.array_equal(np.asarray(last.data), host[last.index] * 2)
    print(json.dumps(checks), flush=True)


if __name__ == "__main__":
    main()
