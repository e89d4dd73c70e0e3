"""Checkpoint steps under the directory argv[1] with a CheckpointManager while the test kills island 1's
worker during step 2's save (256 MiB on island 1 alone).

Prints JSON when step 2's save begins; then JSON with its failure and the steps the manager has; after
a line on stdin (the worker is back), saves step 3, restores it, and prints JSON with the steps and
whether the restore is right.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from orbax_tree import ocp


def filled(devices, shape, value):  # each device makes its own shard
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    rows = shape[0] // len(devices)

    def make():
        return jnp.full((rows, shape[1]), value, jnp.float32)

    parts = [jax.jit(make, out_shardings=SingleDeviceSharding(d))() for d in devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, parts)


every = jax.devices()[:4]
manager = ocp.CheckpointManager(sys.argv[1], item_handlers=ocp.StandardCheckpointHandler(use_ocdbt=False))
manager.save(1, args=ocp.args.StandardSave({"small": filled(every, (4096, 64), 1)}))
manager.wait_until_finished()
# Step 2 also has 256 MiB on island 1 alone: its worker writes for a while (and is killed meanwhile).
state = {"small": filled(every, (4096, 64), 2), "big": filled(jax.devices()[2:4], (32768, 2048), 2)}
print(json.dumps({"saving": 2}), flush=True)
try:
    manager.save(2, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    failure = None
except Exception as error:  # noqa: BLE001 - the failure is what the test checks
    failure = str(error)
del state
manager.reload()
print(json.dumps({"failure": failure, "steps": manager.all_steps()}), flush=True)
sys.stdin.readline()  # the test brings the worker back
manager.save(3, args=ocp.args.StandardSave({"small": filled(every, (4096, 64), 3)}))
manager.wait_until_finished()
sharding = NamedSharding(Mesh(np.array(every), ("x",)), P("x"))
target = {"small": jax.ShapeDtypeStruct((4096, 64), jnp.float32, sharding=sharding)}
restored = np.asarray(manager.restore(3, args=ocp.args.StandardRestore(target))["small"])
steps = ocp.CheckpointManager(sys.argv[1]).all_steps()
print(json.dumps({"steps": steps, "restored": bool((restored == 3).all())}), flush=True)
