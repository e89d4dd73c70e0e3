"""A colocated call on an array sharded over both islands' CPU devices (several hosts): refused.

Says what it raised.
"""

import jax
import numpy as np
from colocated_client import connect, say
from jax.experimental import colocated_python as cp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

cpus = connect()
both_islands = NamedSharding(Mesh(np.array(cpus), ("x",)), P("x"))
x = jax.device_put(np.arange(8, dtype=np.float32), both_islands)
try:
    np.asarray(cp.colocated_python(lambda x: x * 2)(x))
    say(raised=None)
except Exception as error:  # noqa: BLE001 - the refusal is what the test checks
    say(raised=type(error).__name__, message=str(error))
