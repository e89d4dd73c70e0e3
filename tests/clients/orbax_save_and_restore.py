"""Saves the tree through the cluster's workers to the checkpoint argv[1] with Orbax's StandardCheckpointer,
then restores it three ways: on the same mesh, on island 1's two devices with other shardings, and
from the checkpoint's metadata with shardings only.

Prints JSON lines: the runtime and Orbax handler in use, when the save ran and how much the client's
peak memory grew; then, for each restore, which arrays came back bitwise equal (and where). Writes the
tree's values to the .npz argv[2].
"""

import json
import resource
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax_tree import host_values, ocp, same, tree

path = sys.argv[1]
handler = type(ocp.type_handlers.get_type_handler(jax.Array)).__name__
state = tree(jax.devices()[:4])
expected = host_values(state)
expected_dtypes = {k: v.dtype for k, v in state.items()}
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.time()
checkpointer = ocp.StandardCheckpointer(use_ocdbt=False)
checkpointer.save(path, state)
checkpointer.wait_until_finished()
print(
    json.dumps(
        {
            "runtime_type": jax.devices()[0].client.runtime_type,
            "handler": handler,
            "save": [started, time.time()],
            "peak_growth_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak,
        }
    ),
    flush=True,
)


def targets(mesh, specs):
    # A PRNG key's target is its key data's (Orbax 0.12.8's Pathways handler gets a key-typed target's
    # shape wrong; docs/checkpoints.md); it comes back as a key.
    physical = {**state, "key": jax.random.key_data(state["key"])}
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k])) for k, v in physical.items()
    }


same_mesh = state["w"].sharding.mesh
specs = {k: v.sharding.spec for k, v in state.items()}
restored = checkpointer.restore(path, targets(same_mesh, specs))
print(json.dumps({"same mesh": same(restored, expected, expected_dtypes)}), flush=True)
# Island 1's two devices only, every array split or replicated differently from the save.
other = Mesh(np.array(jax.devices()[2:4]), ("x",))
other_specs = {"w": P(None, "x"), "b": P("x"), "steps": P("x"), "key": P()}
restored = checkpointer.restore(path, targets(other, other_specs))
print(
    json.dumps(
        {
            "other mesh": same(restored, expected, expected_dtypes),
            "on": sorted({d.id for v in restored.values() for d in v.devices()}),
        }
    ),
    flush=True,
)
# Only shardings: Orbax reads shapes and dtypes from the checkpoint (the client opens each .zarray).
restore_args = {k: ocp.ArrayRestoreArgs(sharding=NamedSharding(same_mesh, specs[k])) for k in state}
restored = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
print(json.dumps({"from metadata": same(restored, expected, expected_dtypes)}), flush=True)
np.savez(sys.argv[2], **expected)
