"""Each device of the cluster has a colocated CPU device beside it, and ``jax.devices()`` is unchanged.

Says the devices and their kinds, the colocated CPU devices, their pairs and islands, and an array's
round trip from a device to its CPU device and back.
"""

import jax
import numpy as np
from colocated_client import connect, say

cpus = connect()
devices = jax.devices()
x = jax.device_put(np.arange(6.0), devices[3])
on_cpu = jax.device_put(x, cpus[3])
back = jax.device_put(on_cpu * 2, devices[3])
say(
    devices=[d.id for d in devices],
    local_count=jax.local_device_count(),
    kinds=sorted({d.device_kind for d in devices}),
    cpus=[d.id for d in cpus],
    cpu_kinds=sorted({d.device_kind for d in cpus}),
    pairs=[[d.colocation_id, c.colocation_id] for d, c in zip(devices, cpus, strict=True)],
    islands=[c.slice_index for c in cpus],
    on_cpu=[d.id for d in on_cpu.devices()],
    back=np.asarray(back).tolist(),
)
