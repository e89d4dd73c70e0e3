"""New shapes, dtypes and programs on an island whose worker the test kills, on the cluster at argv[1].

Prints JSON with a first result from island 1. After a line on stdin (the worker is dead), JSON with
the outcome of each kind of new work there (each must fail clearly, the process must live), and of
work on island 0. After another line (the resource manager shows the worker back), JSON with a fresh
program's result on island 1 (retried until the proxy has heard of it, 60 s at most) and what became
of the array kept on the old worker.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb
from pathways_nb.testing import wait_until

pathways_nb.connect(sys.argv[1], tenant="survivor")
island0, island1 = jax.devices()[0], jax.devices()[2]
kept = jax.device_put(np.arange(4, dtype=np.float32), island1)
print(json.dumps({"before": float(jax.jit(lambda x: x.sum())(kept))}), flush=True)
sys.stdin.readline()  # the test kills island 1's worker


def attempt(work):
    try:
        return {"value": np.asarray(work()).tolist()}
    except Exception as error:  # noqa: BLE001 - the client process must live; the test checks the error
        return {"error": f"{type(error).__name__}: {error}"}


# Shapes, dtypes and programs the client has never used: each needs new layouts and compiles.
report = {
    "put": attempt(lambda: jax.device_put(np.ones((7, 3), np.int16), island1)),
    "jit": attempt(lambda: jax.jit(lambda x: jnp.cos(x) * 3)(jax.device_put(np.ones(5, np.float16), island1))),
    "kept": attempt(lambda: kept * 2),
    "island0": attempt(lambda: jax.jit(lambda x: x - 1)(jax.device_put(np.full((2, 9), 3, np.int8), island0))),
}
print(json.dumps(report), flush=True)
sys.stdin.readline()  # the resource manager shows it back
try:  # the proxy hears of it within its next update
    fresh = wait_until(
        lambda: attempt(lambda: jax.jit(lambda x: x + 1)(jax.device_put(np.full(3, 41, np.float32), island1))),
        60,
        "island 1 serving again",
        holds=lambda outcome: "value" in outcome,
        interval_s=0.25,
    )
except TimeoutError as error:
    fresh = {"error": str(error)}
report = {
    "fresh": fresh,
    "kept": attempt(lambda: kept + 1),  # lost with the old process: stays lost
}
print(json.dumps(report), flush=True)
