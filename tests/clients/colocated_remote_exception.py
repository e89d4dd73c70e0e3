"""A colocated function that raises, then another call to the same executor.

Says what the first call raised (its type and message), then the second's result.
"""

import jax
import numpy as np
from colocated_client import connect, say
from jax.experimental import colocated_python as cp

cpus = connect()


@cp.colocated_python
def fails(x):
    raise ValueError("the input pipeline ran dry")


x = jax.device_put(np.ones(2, np.float32), cpus[0])
try:
    np.asarray(fails(x))
    say(raised=None)
except Exception as error:  # noqa: BLE001 - what arrives is what the test checks
    say(raised=type(error).__name__, message=str(error))
ok = cp.colocated_python(lambda x: x + 1)
say(after=np.asarray(ok(x)).tolist())
