"""pathwaysutils' slice health checks on the cluster at argv[1], and a program compiled while a slice is down.

Prints JSON with the active slices; then, for each line on stdin (the test kills island 1, then
brings it back), JSON with the active slices and the outcome of a program run on island 1.
"""

import json
import sys

import jax
import numpy as np
from pathwaysutils.elastic import elastic

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="checks")
slices = elastic.get_slice_to_devices(jax.devices())
fresh = jax.jit(lambda x: x * 3 - 1)


def report():
    try:
        active = sorted(elastic.get_active_slice_indices(slices))
    except Exception as error:  # noqa: BLE001 - pathwaysutils counts no slice down here; the test says so
        active = f"the health check failed: {type(error).__name__}: {error}"
    try:
        result = fresh(jax.device_put(np.float32(2), slices[1][0]))
    except Exception as error:  # noqa: BLE001 - the test checks how the dispatch failed
        return {"active": active, "run": f"dispatch failed: {type(error).__name__}: {error}"}
    try:
        return {"active": active, "run": float(result)}
    except jax.errors.JaxRuntimeError as error:
        return {"active": active, "run": f"read failed: {error}"}


print(json.dumps({"active": sorted(elastic.get_active_slice_indices(slices))}), flush=True)
for _line in sys.stdin:  # the test kills island 1, then brings it back
    print(json.dumps(report()), flush=True)
