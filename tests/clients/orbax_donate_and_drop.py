"""Saves under the directory argv[1] an array the next training step donates (``donated``), and one
nobody holds any more but the save (``dropped``); restores both.

Prints JSON: whether the step's result and both restored arrays are what they must be.
"""

import gc
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax_tree import ocp

sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), P("x"))
make = jax.jit(lambda: jnp.arange(1 << 22, dtype=jnp.float32).reshape(1024, 4096), out_shardings=sharding)
checkpointer = ocp.StandardCheckpointer(use_ocdbt=False)
# The next training step donates the state the save is still writing: it runs once the write is done.
state = make()
checkpointer.save(sys.argv[1] + "/donated", {"w": state})
stepped = jax.jit(lambda w: w + 1, donate_argnums=0)(state)
checkpointer.wait_until_finished()
# An array nobody holds any more but the save: the client deletes it, after the write.
checkpointer.save(sys.argv[1] + "/dropped", {"w": make()})
gc.collect()
checkpointer.wait_until_finished()
target = {"w": jax.ShapeDtypeStruct((1024, 4096), jnp.float32, sharding=sharding)}
expected = np.arange(1 << 22, dtype=np.float32).reshape(1024, 4096)


def restored(name):
    return bool(np.array_equal(np.asarray(checkpointer.restore(sys.argv[1] + name, target)["w"]), expected))


print(
    json.dumps(
        {
            "stepped": bool(np.array_equal(np.asarray(stepped), expected + 1)),
            "donated": restored("/donated"),
            "dropped": restored("/dropped"),
        }
    )
)
