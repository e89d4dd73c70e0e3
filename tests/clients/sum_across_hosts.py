"""Connects to argv[1] and runs one program over every device, of every host: each host runs its part.

Prints JSON: the hosts of the devices, and the program's result (140.0). argv[2] (the islands) is not
used: the program spans the only island.
"""

import json
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pathways_nb

pathways_nb.connect(sys.argv[1], timeout_s=60, progress=False)
x = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x")))
total = float(jax.jit(lambda v: (v * v).sum())(x))
print(json.dumps({"hosts": sorted({d.host_index for d in jax.devices()}), "results": total}))
pathways_nb.disconnect()
