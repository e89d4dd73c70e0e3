"""A question that island 0's worker must answer: a compiled program's cost analysis.

argv[1]: the proxy's address. Prints ``ready`` once compiled; after a line on stdin prints ``asking``,
asks, and prints ``flops N``.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="slow", islands=[0])
compiled = jax.jit(lambda a: jnp.tanh(a @ a)).lower(np.ones((64, 64), np.float32)).compile()
print("ready", flush=True)
sys.stdin.readline()
print("asking", flush=True)
costs = compiled.cost_analysis()  # the worker answers this one
costs = costs[0] if isinstance(costs, list) else costs
print("flops", costs["flops"], flush=True)
