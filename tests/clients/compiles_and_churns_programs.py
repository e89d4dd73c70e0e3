"""Connects to argv[1] (token argv[2]), compiles a program every client of this script shares and keeps
it, then compiles, runs and drops argv[3] distinct programs.

Prints the kept program's result, then ``churned``; then, for each line on stdin: ``run`` runs the
kept program again, ``drop`` drops it (prints ``dropped``), ``recompile`` compiles it again.
"""

import gc
import sys

import jax
import numpy as np

import pathways_nb

address, token, churn = sys.argv[1], sys.argv[2], int(sys.argv[3])
pathways_nb.connect(address, token=token)
x = jax.device_put(np.arange(8, dtype=np.float32), jax.devices()[0])


def shared():
    return jax.jit(lambda v: v * 3 + 1).lower(x).compile()


def step(i):
    return jax.jit(lambda v: v * 2 + i).lower(x).compile()  # a distinct program for each i


kept = shared()
print(np.asarray(kept(x)).tolist(), flush=True)
for i in range(churn):
    assert np.asarray(step(i)(x)).tolist() == (np.arange(8) * 2 + i).tolist()
gc.collect()
print("churned", flush=True)
for command in iter(sys.stdin.readline, ""):
    if command.strip() == "run":
        print(np.asarray(kept(x)).tolist(), flush=True)
    elif command.strip() == "drop":
        del kept
        gc.collect()
        print("dropped", flush=True)
    elif command.strip() == "recompile":
        kept = shared()
        print(np.asarray(kept(x)).tolist(), flush=True)
