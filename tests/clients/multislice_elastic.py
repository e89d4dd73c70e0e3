"""pathwaysutils' elastic Manager trains one data-parallel model over every active island, through a loss.

Each step is one program over a mesh of the active islands' devices (dcn x ici): the batch is split over
both axes and XLA averages the gradient across islands. When the test kills island 1's worker the step
fails with DATA_LOSS, the Manager goes on with island 0 alone, and once the island is back it scales up
and the program spans both again. argv: the proxy's address. Prints {"slices": [...]}, then {"kill": true}
(the test then kills, and writes a line), then the record of which islands each step used.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from pathwaysutils.elastic import manager as elastic

import pathways_nb


def main() -> None:
    pathways_nb.connect(sys.argv[1], tenant="elastic", timeout_s=60, progress=False)
    mgr = elastic.Manager()
    print(json.dumps({"slices": sorted(mgr.active_slice_indices)}), flush=True)
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((32, 4)).astype(np.float32)
    targets = inputs @ np.array([1.0, -2.0, 3.0, 0.5], np.float32)
    state = {"w": np.zeros(4, np.float32), "used": [], "killed": False}

    @jax.jit
    def step(w, x, y):
        return w - 0.05 * jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)

    @mgr.elastic_retry(minimum_slice_count=1, poll_interval=0.5, timeout=120)
    def train():
        slices = sorted(mgr.active_slice_indices)
        devices = [d for i in slices for d in mgr.slice_to_devices[i]]
        mesh = Mesh(np.array(devices).reshape(len(slices), -1), ("dcn", "ici"))
        batch, replicated = NamedSharding(mesh, P(("dcn", "ici"))), NamedSharding(mesh, P())
        x, y = jax.device_put(inputs, batch), jax.device_put(targets, batch)
        w = jax.device_put(state["w"], replicated)
        while True:
            if len(state["used"]) == 3 and not state["killed"]:
                state["killed"] = True
                print(json.dumps({"kill": True}), flush=True)
                sys.stdin.readline()  # the test kills island 1's worker
            if mgr.available_inactive_slices:
                raise elastic.ScaleUpSignalError("a slice came back")
            w = step(w, x, y)
            state["w"] = np.asarray(w)
            state["used"].append(slices)
            # Done once both islands serve again after the survivor trained alone (or, if it never did,
            # after enough steps for the test to say so instead of training forever).
            if state["used"][-3:] == [[0, 1]] * 3 and ([0] in state["used"] or len(state["used"]) > 100):
                return state

    result = train()
    print(json.dumps({"used": result["used"], "w": result["w"].tolist()}), flush=True)


if __name__ == "__main__":
    main()
