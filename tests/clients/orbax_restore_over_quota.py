"""Saves 4 MiB to the checkpoint argv[1], then restores it while the array is still held: over the
session's 6 MiB device quota. Then deletes the array and restores again.

Prints JSON: what the first restore gave, and whether the second is right.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax_tree import ocp

sharding = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("x",)), P("x"))
w = jax.jit(lambda: jnp.ones((1024, 1024), jnp.float32), out_shardings=sharding)()  # 4 MiB of the 6 allowed
checkpointer = ocp.StandardCheckpointer(use_ocdbt=False)
checkpointer.save(sys.argv[1], {"w": w})
checkpointer.wait_until_finished()
target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding)}
try:
    checkpointer.restore(sys.argv[1], target)
    over = "restored"
except Exception as error:  # noqa: BLE001 - the refusal is what the test checks
    over = str(error)
w.delete()
restored = checkpointer.restore(sys.argv[1], target)["w"]
print(json.dumps({"over": over, "after": bool((np.asarray(restored) == 1).all())}))
