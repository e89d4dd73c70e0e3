"""Connects to argv[1] with the cluster token argv[2] as tenant argv[3], runs a jit, and holds its session.

Prints JSON: the jit's result, how many workers the session's view of the cluster shows, and the
session's secret; then holds the session until its stdin closes.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb

session = pathways_nb.connect(sys.argv[1], token=sys.argv[2], tenant=sys.argv[3])
result = jax.jit(lambda x: jnp.sin(x) * 2)(np.arange(4, dtype=np.float32))
print(
    json.dumps(
        {
            "result": np.asarray(result).tolist(),
            "workers": len(session.state().workers),
            "secret": session.secret,
        }
    ),
    flush=True,
)
sys.stdin.read()
os._exit(0)
