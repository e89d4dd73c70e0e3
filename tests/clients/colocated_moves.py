"""A session with colocated Python moves to other devices: its arrays on colocated CPU devices go with it.

Connects to argv[1] with the cluster token argv[2] as tenant argv[3], with two devices to itself on any island;
keeps an array on a colocated CPU device and a colocated function's result, says ``{"ready": ...}`` and waits for
a line on stdin (meanwhile its session is suspended and its island taken: it resumes on the other island); then
calls the function on the kept result and says what it found.
"""

import sys

import jax
import numpy as np
from colocated_client import say
from jax.experimental import colocated_python as cp

import pathways_nb

pathways_nb.connect(sys.argv[1], token=sys.argv[2], tenant=sys.argv[3], exclusive=True, num_devices=2)
cpus = cp.colocated_cpu_devices(jax.devices())


@cp.colocated_python
def triple(x):
    return jax.device_put(np.asarray(x) * 3, x.sharding)


x_host = np.arange(8, dtype=np.float32)
x = jax.device_put(x_host, cpus[1])
y = triple(x)
say(ready=[d.id for d in cpus])
sys.stdin.readline()
say(
    x_equal=np.array_equal(np.asarray(x), x_host),
    y_equal=np.array_equal(np.asarray(y), x_host * 3),
    called_again=np.array_equal(np.asarray(triple(y)), x_host * 9),
    cpus=[d.id for d in cp.colocated_cpu_devices(jax.devices())],
)
