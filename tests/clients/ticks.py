"""Tiny programs on device argv[2] of the proxy at argv[1] (island 0's), until a line on stdin.

With argv[3] = N > 0, every N-th tick is a program never seen before (compiled first, on the same worker).
Prints ``ready``, then at the end JSON: each tick's start (``time.time()``), round trip, and whether it
compiled.
"""

import json
import sys
import threading
import time

import jax
import numpy as np

import pathways_nb

pathways_nb.connect(sys.argv[1], tenant="ticker", islands=[0])
device, compile_every = jax.devices()[int(sys.argv[2])], int(sys.argv[3])
step = jax.jit(lambda x: x + 1)


def new_program(k: int):
    """A program never compiled before: its constant is new."""
    return jax.jit(lambda x: x + k)


x = jax.device_put(np.float32(1), device)
float(step(x))
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
print("ready", flush=True)
ticks = []
while not stop.is_set():
    fresh = compile_every > 0 and len(ticks) % compile_every == compile_every - 1
    program = new_program(len(ticks)) if fresh else step
    started = time.time()
    float(program(x))
    ticks.append((started, time.time() - started, fresh))
print(json.dumps(ticks), flush=True)
