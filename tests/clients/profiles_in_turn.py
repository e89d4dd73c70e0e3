"""pathwaysutils' profiling over and over (each start and stop a plugin program the proxy compiles), until a
line on stdin. Its functions are called directly: ``pathwaysutils.initialize()``, which would put them in
``jax.profiler``'s place, cannot follow ``pathways_nb.connect`` (docs/checkpoints.md).

argv[1]: the proxy's address (island 0 is this session's); argv[2]: the cluster's storage root, where
``gs://bucket`` is. Prints ``ready``, then at the end the number of traces taken.
"""

import sys
import threading

import jax
import numpy as np
from pathwaysutils import profiling

import pathways_nb

storage = sys.argv[2]
original = profiling._original_start_trace


def start_trace_offline(log_dir, **kw):
    """The client's own export goes where the cluster's gs://bucket is (offline, jaxlib cannot write gs://)."""
    return original(str(log_dir).replace("gs://", storage + "/"), **kw)


profiling._original_start_trace = start_trace_offline
pathways_nb.connect(sys.argv[1], tenant="profiler", islands=[0])
x = jax.device_put(np.ones((64, 64), np.float32), jax.devices()[0])
step = jax.jit(lambda a: a @ a)
step(x).block_until_ready()
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
print("ready", flush=True)
traces = 0
while not stop.is_set():
    profiling.start_trace(f"gs://bucket/turn{traces}")
    step(x).block_until_ready()
    profiling.stop_trace()
    traces += 1
print(traces, flush=True)
