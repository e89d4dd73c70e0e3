"""Restores the checkpoint argv[1] (arrays ``w`` and ``b``) with local Orbax onto this process's CPU
device, no cluster; prints JSON with their values.
"""

import json
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

on_cpu = ocp.ArrayRestoreArgs(sharding=jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]))
restored = ocp.PyTreeCheckpointer().restore(sys.argv[1], restore_args={"w": on_cpu, "b": on_cpu})
print(json.dumps({k: np.asarray(v).tolist() for k, v in restored.items()}))
