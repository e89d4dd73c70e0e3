"""Connects to argv[1], where given, and prints JSON about ``jax.devices()``: their count, the first's
repr, and its platform. Without an address, JAX is whatever its environment makes it.
"""

import json
import sys

import jax

if len(sys.argv) > 1:
    import pathways_nb

    pathways_nb.connect(sys.argv[1])
devices = jax.devices()
print(json.dumps({"count": len(devices), "first": repr(devices[0]), "platform": devices[0].platform}))
