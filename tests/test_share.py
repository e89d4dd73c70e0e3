"""Proportional share: two tenants saturating one island get device time in the ratio of their weights."""

from __future__ import annotations

import time

from pathways_nb.cluster import LocalCluster
from pathways_nb.observe import Observer
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


def _device_time(events, start: float, end: float) -> float:
    """Seconds of device time in [start, end] of ``execute`` events."""
    return sum(max(0.0, min(e.end, end) - max(e.start, start)) for e in events if e.kind == "execute")


def test_device_time_follows_the_weights_when_the_island_is_saturated():
    with LocalCluster(islands=1, devices_per_host=1) as cluster:
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
    executes = {t: [e for e in evs if e.kind == "execute"] for t, evs in events.items()}
    # While both were busy: from the later first execution to the earlier last one.
    start = max(min(e.start for e in evs) for evs in executes.values()) + 1.0
    end = min(max(e.end for e in evs) for evs in executes.values()) - 1.0
    assert end - start > 8, (start, end)
    light, heavy = (_device_time(executes[t], start, end) for t in ("light", "heavy"))
    busy = (light + heavy) / (end - start)
    assert busy > 0.8, (busy, heavy, light)  # the island was saturated
    print(f"device time: heavy {heavy:.2f} s, light {light:.2f} s, ratio {heavy / light:.2f}, busy {busy:.2f}")
    assert 2.7 <= heavy / light <= 3.3, (heavy, light)
    # The waits for a turn are on the timeline too.
    assert any(e.kind == "wait" and e.name.endswith("waits its turn") for e in events["light"])
