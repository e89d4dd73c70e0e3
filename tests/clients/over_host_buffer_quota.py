"""Uploads 80 MiB to the proxy at argv[1], over its 64 MiB host-buffer quota, then a small array.

Prints JSON: the refusal of the big upload, and the small array's sum (the session lives on).
"""

import json
import sys

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1])
report = {}
try:
    np.asarray(jax.device_put(np.ones((20 << 20,), np.float32)))  # an 80 MiB upload: over 64 MiB
    report["over"] = "no error"
except jax.errors.JaxRuntimeError as e:
    report["over"] = str(e)
report["after"] = float(np.asarray(jax.device_put(np.full((4,), 3, np.float32))).sum())  # the session lives
print(json.dumps(report))
