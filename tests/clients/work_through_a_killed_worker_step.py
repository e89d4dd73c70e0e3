"""Works on both islands of the Slurm job's cluster at argv[1] (token: PATHWAYS_CLUSTER_TOKEN) while the
test kills island 1's worker step, and after Slurm has started it again.

Prints JSON with a first result from island 1. After a line on stdin (the step is dead, and the resource
manager says why), JSON with what became of an array island 1 held, of work on island 0, and of new work
on island 1 (retried until its error names the cause, 30 s at most). After another line (the island is
back), JSON with new work's result on island 1 (retried until the proxy has heard of it, 60 s at most).
"""

import json
import sys

import jax
import numpy as np

import pathways_nb
from pathways_nb.testing import wait_until

pathways_nb.connect(sys.argv[1], timeout_s=60, progress=False)
island0, island1 = jax.devices()[0], jax.devices()[2]


def attempt(work):
    try:
        return {"value": np.asarray(work()).tolist()}
    except Exception as error:  # noqa: BLE001 - the client process must live; the test checks the error
        return {"error": f"{type(error).__name__}: {error}"}


def retried(work, timeout_s: float, what: str, done) -> dict:
    """``attempt(work)`` until ``done`` holds of its outcome (the proxy hears of the island with its next
    update); past ``timeout_s``, the time-out's error, which shows the last outcome."""
    try:
        return wait_until(lambda: attempt(work), timeout_s, what, holds=done, interval_s=0.1)
    except TimeoutError as error:
        return {"error": str(error)}


kept = jax.device_put(np.arange(4, dtype=np.float32), island1)
print(json.dumps({"before": float(kept.sum())}), flush=True)
sys.stdin.readline()  # the test kills island 1's step; the cluster knows
report = {"kept": attempt(lambda: kept * 2), "island0": attempt(lambda: jax.device_put(np.ones(3), island0) + 1)}
report["new"] = retried(
    lambda: jax.device_put(np.ones(3), island1) + 1,
    30,
    "new work on island 1 failing with the cause, or done",
    lambda outcome: "value" in outcome or "Slurm node" in outcome.get("error", ""),
)
print(json.dumps(report), flush=True)
sys.stdin.readline()  # the island is back
fresh = retried(
    lambda: jax.device_put(np.full(3, 41.0), island1) + 1, 60, "island 1 serving again", lambda o: "value" in o
)
print(json.dumps({"fresh": fresh}), flush=True)
