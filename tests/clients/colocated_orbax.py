"""Orbax's Pathways handlers (colocated Python, their default) save a tree on island 0 to the
checkpoint argv[4] if argv[5] is ``save``, then restore it with the same shardings.

Says the restored values, and whether their shardings are the saved arrays'.
"""

import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from colocated_client import connect, say
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

connect()
os.umask(0)  # directories this client makes, the executors (other users) write into
path, save = sys.argv[4], sys.argv[5] == "save"
mesh = Mesh(np.array(jax.devices()[:2]), ("x",))  # island 0's devices
tree = {
    "w": jax.device_put(np.arange(16, dtype=np.float32).reshape(4, 4), NamedSharding(mesh, P("x"))),
    "b": jax.device_put(np.array([1.5, -2.0], np.float32), NamedSharding(mesh, P())),
}
ocp.pathways.register_type_handlers()  # its default dispatcher: colocated Python
checkpointer = ocp.PyTreeCheckpointer()
if save:
    checkpointer.save(path, tree)
restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), tree)
restored = checkpointer.restore(path, restore_args=restore_args)
say(
    restored={k: np.asarray(v).tolist() for k, v in restored.items()},
    shardings_kept=all(restored[k].sharding == tree[k].sharding for k in tree),
)
