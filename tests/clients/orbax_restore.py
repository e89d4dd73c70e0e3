"""Restores the checkpoint argv[1] with a StandardCheckpointer onto the tree's shardings (through the
cluster's workers in a client of a cluster, with stock Orbax in plain local JAX).

Prints JSON: which arrays came back bitwise equal to the tree, in its dtypes.
"""

import json
import sys

import jax
from orbax_tree import host_values, ocp, same, tree

state = tree(jax.devices()[:4])
expected, expected_dtypes = host_values(state), {k: v.dtype for k, v in state.items()}
physical = {**state, "key": jax.random.key_data(state["key"])}
target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in physical.items()}
print(json.dumps({"same": same(ocp.StandardCheckpointer().restore(sys.argv[1], target), expected, expected_dtypes)}))
