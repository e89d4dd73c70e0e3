"""Data-parallel SGD over both islands of the cluster at argv[1] under pathwaysutils' elastic Manager,
through the death of island 1's worker and its return.

Prints JSON with the active slices; after 3 steps, JSON asking the test to kill island 1's worker, and
waits for a line on stdin. Trains on what is active, scales up when a slice comes back, and ends once
both islands served 3 steps again after the survivor trained alone (or after 100 steps), printing
JSON with the steps and the slices each used.
"""

import json
import sys

import jax
import numpy as np
from pathwaysutils.elastic import manager as elastic

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="elastic")
mgr = elastic.Manager()
print(json.dumps({"slices": sorted(mgr.active_slice_indices)}), flush=True)
step = jax.jit(lambda w, x: w - 0.1 * (w * x - 1.0) * x)  # SGD on (w x - 1)^2 / 2
state = {"w": 0.0, "steps": 0, "used": [], "killed": False}


@mgr.elastic_retry(minimum_slice_count=1, poll_interval=0.5, timeout=60)
def train():
    slices = sorted(mgr.active_slice_indices)
    while True:
        if state["steps"] == 3 and not state["killed"]:
            state["killed"] = True
            print(json.dumps({"kill": True}), flush=True)
            sys.stdin.readline()  # the test kills island 1's worker
        if mgr.available_inactive_slices:
            raise elastic.ScaleUpSignalError("a slice came back")
        # Data parallel: each active slice takes its shard of the batch; the host averages.
        updates = [
            step(
                jax.device_put(np.float32(state["w"]), mgr.slice_to_devices[i][0]),
                jax.device_put(np.float32(1.0 + i), mgr.slice_to_devices[i][0]),
            )
            for i in slices
        ]
        state["w"] = float(np.mean([np.asarray(u) for u in updates]))
        state["steps"] += 1
        state["used"].append(slices)
        # Done once both islands serve again after the survivor trained alone (or, if it never
        # did, after enough steps for the assertions to say so instead of training forever).
        if state["used"][-3:] == [[0, 1]] * 3 and ([0] in state["used"] or len(state["used"]) > 100):
            return state


print(json.dumps(train()), flush=True)
