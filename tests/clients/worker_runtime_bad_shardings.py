"""A worker's runtime (4 CPU devices in this process) given bad shardings, then a good one.

Prints ``name|outcome`` for each bad sharding and each of ``check_sharding`` and ``jax_sharding``
(the error's type and message, or ``accepted``), then ``good|True`` if the good sharding placed each
shard where it says.
"""

import numpy as np

from pathways_nb.protocol import schema
from pathways_nb.protocol.errors import RequestError
from pathways_nb.protocol.shardings import IfrtSharding
from pathways_nb.worker.runtime import LocalRuntime

runtime = LocalRuntime("cpu", 4)
OpSharding = schema.load().xla.OpSharding
tiled = OpSharding(type=3, tile_assignment_dimensions=[2, 2], iota_reshape_dims=[4], iota_transpose_perm=[0])
named = OpSharding(type=3)
named.named_sharding.mesh.axes.add(name="x", size=2)
named.named_sharding.dim_shardings.add().axes.add(mesh_axis_index=0)
bad = {
    "empty": IfrtSharding(()),
    "empty tiled": IfrtSharding((), None, tiled.SerializeToString()),
    "count": IfrtSharding((0, 1), None, tiled.SerializeToString()),
    "named": IfrtSharding((0, 1), None, named.SerializeToString()),
    "memory": IfrtSharding((0, 1), "hbm"),
    "twice": IfrtSharding((0, 0)),
    "unknown": IfrtSharding((0, 9)),
}
for name, sharding in bad.items():
    for method in (runtime.check_sharding, runtime.jax_sharding):
        try:
            method(sharding)
        except RequestError as e:
            print(f"{name}|{type(e).__name__} {e.message}")
        else:
            print(f"{name}|accepted")
good = IfrtSharding((3, 2, 1, 0), None, tiled.SerializeToString())
array = runtime.put(np.arange(16, dtype=np.float32).reshape(4, 4), good)
placed = {shard.device.id: shard.index for shard in array.addressable_shards}
print(f"good|{placed == dict(zip(good.device_ids, good.shard_indices((4, 4)), strict=True))}")
