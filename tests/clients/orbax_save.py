"""Saves the tree to the checkpoint argv[1] with a StandardCheckpointer made with the JSON options argv[2]
(through the cluster's workers in a client of a cluster, with stock Orbax in plain local JAX).
"""

import json
import sys

import jax
from orbax_tree import ocp, tree

checkpointer = ocp.StandardCheckpointer(**json.loads(sys.argv[2]))
checkpointer.save(sys.argv[1], tree(jax.devices()[:4]))
checkpointer.wait_until_finished()
