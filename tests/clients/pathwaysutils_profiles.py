"""pathwaysutils' profiling as on Pathways on Cloud: two traces of a training step on both islands.

Run with ``JAX_PLATFORMS=proxy`` and ``JAX_BACKEND_TARGET`` set to the cluster; argv[1] is the
cluster's storage root, where its ``gs://bucket`` is. Starts a trace, tries a second start and a
trace of another executable (both refused), stops it; then traces again as a context manager.
Prints JSON with the two refusals' messages.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pathwaysutils
from pathwaysutils import profiling
from pathwaysutils.plugin_executable import PluginExecutable

storage = sys.argv[1]
original = profiling._original_start_trace


def start_trace_offline(log_dir, **kw):
    """The client's own export goes where the cluster's gs://bucket is (offline, jaxlib cannot write gs://)."""
    return original(str(log_dir).replace("gs://", storage + "/"), **kw)


profiling._original_start_trace = start_trace_offline
pathwaysutils.initialize()

devices = jax.devices()
firsts = [next(d for d in devices if d.slice_index == i) for i in (0, 1)]
step = jax.jit(lambda x: jnp.tanh(x @ x))
xs = [jax.device_put(np.full((128, 128), 0.01, np.float32), d) for d in firsts]
jax.block_until_ready([step(x) for x in xs])
report = {}


def train():
    global xs
    for _ in range(4):
        xs = [step(x) for x in xs]
    jax.block_until_ready(xs)


options = jax.profiler.ProfileOptions()
options.session_id = "first"
jax.profiler.start_trace("gs://bucket/run", max_num_hosts=2, profiler_options=options)
try:
    jax.profiler.start_trace("gs://bucket/run", max_num_hosts=2)
except RuntimeError as error:
    report["double_start"] = str(error)
# Another executable (another tenant's, say) cannot start a second trace on the same hosts.
other = PluginExecutable(json.dumps({"profileRequest": {"traceLocation": "gs://bucket/other", "maxNumHosts": 2}}))
try:
    other.call()[1].result()
except Exception as error:  # noqa: BLE001 - the refusal is what the test checks
    report["second_start"] = str(error)
train()
jax.profiler.stop_trace()

options = jax.profiler.ProfileOptions()
options.session_id = "second"
with jax.profiler.trace("gs://bucket/run", max_num_hosts=2, profiler_options=options):
    train()
print(json.dumps(report), flush=True)
