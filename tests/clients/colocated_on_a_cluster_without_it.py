"""A colocated call on the cluster at argv[1] (token argv[2]), which runs no colocated Python.

Prints JSON: what the call raised.
"""

import json
import sys

import jax
import numpy as np
from jax.experimental import colocated_python as cp

import pathways_nb

pathways_nb.connect(sys.argv[1], token=sys.argv[2])
x = jax.device_put(np.ones(2, np.float32), jax.devices()[0])
try:
    np.asarray(cp.colocated_python(lambda x: x)(x))
    print(json.dumps({"raised": None}))
except Exception as error:  # noqa: BLE001 - the refusal is what the test checks
    print(json.dumps({"raised": type(error).__name__, "message": str(error)}))
