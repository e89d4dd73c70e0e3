"""Proportional share on an island of two hosts: programs that span both follow the tenants' weights too.

As in ``test_share``, two tenants (weights 1 and 3) keep the island busy and the device time
each gets is read from the timeline; here each program is an SPMD program over both hosts'
devices, whose order host 0 decides (``worker.gang``).
"""

from __future__ import annotations

import time

from pathways_nb.cluster import LocalCluster
from pathways_nb.observe import Observer
from pathways_nb.testing import python_process

BUSY = """
    import sys, time, jax, jax.numpy as jnp, numpy as np, pathways_nb
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    address, token, tenant = sys.argv[1:4]
    weight, seconds = float(sys.argv[4]), float(sys.argv[5])
    pathways_nb.connect(address, token=token, tenant=tenant, weight=weight)
    rows = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))    # both hosts' devices
    step = jax.jit(lambda a: jnp.tanh(a @ a.T) / 600, out_shardings=rows)   # a cross-host all-gather
    x = jax.device_put(np.ones((600, 600), np.float32), rows)
    outstanding, started = [], time.monotonic()
    print("ready", flush=True)
    sys.stdin.readline()
    while time.monotonic() - started < seconds:
        outstanding.append(step(x))                                         # always some work queued
        if len(outstanding) > 32:
            outstanding.pop(0).block_until_ready()
    for y in outstanding:
        y.block_until_ready()
    print("done", flush=True)
"""


def _device_time(events, start: float, end: float) -> float:
    """Seconds of device time in [start, end] of ``execute`` events."""
    return sum(max(0.0, min(e.end, end) - max(e.start, start)) for e in events)


def test_device_time_of_programs_across_hosts_follows_the_weights():
    with LocalCluster(islands=1, hosts_per_island=2, devices_per_host=1) as cluster:
        clients = {
            tenant: python_process(BUSY, cluster.address, cluster.token, tenant, str(weight), "15")
            for tenant, weight in (("light", 1), ("heavy", 3))
        }
        try:
            for client in clients.values():
                assert client.stdout.readline().strip() == "ready", client.stderr.read()[-3000:]
            for client in clients.values():
                client.stdin.write("go\n")
                client.stdin.flush()
            for client in clients.values():
                assert client.stdout.readline().strip() == "done", client.stderr.read()[-3000:]
        finally:
            for client in clients.values():
                client.kill()
                client.communicate()
        time.sleep(0.5)
        observer = Observer(cluster.address, token=cluster.token)
        events = {tenant: observer.events(tenant=tenant) for tenant in clients}
        observer.close()
    # Host 0's parts (device 0): each program runs on both hosts, each host reports its own part.
    executes = {t: [e for e in evs if e.kind == "execute" and list(e.device_ids) == [0]] for t, evs in events.items()}
    start = max(min(e.start for e in evs) for evs in executes.values()) + 1.0
    end = min(max(e.end for e in evs) for evs in executes.values()) - 1.0
    assert end - start > 8, (start, end)
    light, heavy = (_device_time(executes[t], start, end) for t in ("light", "heavy"))
    busy = (light + heavy) / (end - start)
    print(f"device time: heavy {heavy:.2f} s, light {light:.2f} s, ratio {heavy / light:.2f}, busy {busy:.2f}")
    assert busy > 0.5, (busy, heavy, light)  # the island was saturated (less than one host: steps go in turn)
    assert 2.7 <= heavy / light <= 3.3, (heavy, light)
