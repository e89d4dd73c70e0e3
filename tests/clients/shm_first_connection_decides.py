"""Connects to the proxy at argv[1] twice (the same host: fine) and uploads through it, then to argv[2],
a proxy on another host, which the first connection's shared memory cannot serve.

Prints JSON: whether the upload came back equal, and the second server's refusal.
"""

import json
import sys

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1])
pathways_nb.disconnect()
pathways_nb.connect(sys.argv[1])  # the same host again: fine
x = jax.device_put(np.arange(2**20, dtype=np.float32), jax.devices("proxy")[0])
same = bool((np.asarray(x) == np.arange(2**20, dtype=np.float32)).all())
pathways_nb.disconnect()
try:
    pathways_nb.connect(sys.argv[2])
    refused = ""
except pathways_nb.ConnectionFailed as error:
    refused = str(error)
print(json.dumps({"same": same, "refused": refused}))
