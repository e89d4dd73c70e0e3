"""Proportional share: two tenants saturating one island get device time in the ratio of their weights.

Two tenants (weights 1 and 3) keep an island busy; the device time each gets is read from the
timeline. On an island of one host the worker's FairShare decides; on an island of two hosts
each program is an SPMD program over both hosts' devices, whose order host 0 decides
(``worker.gang``) by the same accounting.
"""

from __future__ import annotations

import time

from pathways_nb.client.observe import Observer
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import python_process

BUSY = """
    import sys, time, jax, jax.numpy as jnp, numpy as np, pathways_nb
    address, token, tenant = sys.argv[1:4]
    weight, seconds = float(sys.argv[4]), float(sys.argv[5])
    pathways_nb.connect(address, token=token, tenant=tenant, weight=weight)
    device = jax.devices()[0]
    step = jax.jit(lambda a: jnp.tanh(a @ a) / 700)               # ~10 ms of device time
    x = jax.device_put(np.ones((700, 700), np.float32), device)
    outstanding, started = [], time.monotonic()
    print("ready", flush=True)
    sys.stdin.readline()
    while time.monotonic() - started < seconds:
        outstanding.append(step(x))                                # always some work queued on the island
        if len(outstanding) > 64:
            outstanding.pop(0).block_until_ready()
    for y in outstanding:
        y.block_until_ready()
    print("done", flush=True)
"""

BUSY_ACROSS_HOSTS = """
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


def _share_of_a_busy_island(cluster: LocalCluster, busy: str) -> tuple[float, float, float, dict]:
    """(light's, heavy's device seconds on device 0 while both were busy, how busy it was, every event by tenant)."""
    clients = {
        tenant: python_process(busy, cluster.address, cluster.token, tenant, str(weight), "15")
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
    # Device 0's executions (on two hosts, each host reports its own part of a program).
    executes = {t: [e for e in evs if e.kind == "execute" and list(e.device_ids) == [0]] for t, evs in events.items()}
    # While both were busy: from the later first execution to the earlier last one.
    start = max(min(e.start for e in evs) for evs in executes.values()) + 1.0
    end = min(max(e.end for e in evs) for evs in executes.values()) - 1.0
    assert end - start > 8, (start, end)
    light, heavy = (_device_time(executes[t], start, end) for t in ("light", "heavy"))
    busy = (light + heavy) / (end - start)
    print(f"device time: heavy {heavy:.2f} s, light {light:.2f} s, ratio {heavy / light:.2f}, busy {busy:.2f}")
    return light, heavy, busy, events


def test_device_time_follows_the_weights_when_the_island_is_saturated():
    with LocalCluster(islands=1, devices_per_host=1) as cluster:
        light, heavy, busy, events = _share_of_a_busy_island(cluster, BUSY)
    assert busy > 0.8, (busy, heavy, light)  # the island was saturated
    assert 2.7 <= heavy / light <= 3.3, (heavy, light)
    # The waits for a turn are on the timeline too.
    assert any(e.kind == "wait" and e.name.endswith("waits its turn") for e in events["light"])


def test_device_time_of_programs_across_hosts_follows_the_weights():
    with LocalCluster(islands=1, hosts_per_island=2, devices_per_host=1) as cluster:
        light, heavy, busy, _events = _share_of_a_busy_island(cluster, BUSY_ACROSS_HOSTS)
    assert busy > 0.5, (busy, heavy, light)  # saturated (less than one host's worth: steps go in turn)
    assert 2.7 <= heavy / light <= 3.3, (heavy, light)
