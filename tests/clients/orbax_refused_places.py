"""Saves the tree to places outside the server's storage root (argv[1]: outside it, argv[2]: through
``..``, argv[3]: through a symbolic link), then to argv[4] with a time-out too short for any write.

Prints JSON: each save's outcome (``saved`` or its error).
"""

import datetime
import json
import sys

import jax
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import cloud_pathways_array_handler
from orbax_tree import ocp, tree

state = tree(jax.devices()[:4])


def save(path):
    checkpointer = ocp.StandardCheckpointer(use_ocdbt=False)
    try:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
        return "saved"
    except Exception as error:  # noqa: BLE001 - the refusal is what the test checks
        return str(error)


outcomes = {name: save(path) for name, path in zip(["outside", "dotdot", "symlink"], sys.argv[1:4], strict=True)}
# A timeout too short for any write.
handler = cloud_pathways_array_handler.CloudPathwaysArrayHandler(
    timeout=datetime.timedelta(microseconds=1), array_metadata_store=array_metadata_store.Store()
)
ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
outcomes["timeout"] = save(sys.argv[4])
print(json.dumps(outcomes))
