"""Proportional share: two tenants saturating one island get device time in the ratio of their weights.

Two tenants (weights 1 and 3) keep an island busy; the device time each gets is read from the
timeline. On an island of one host the worker's FairShare decides; on an island of two hosts
each program is an SPMD program over both hosts' devices, whose order host 0 decides
(``worker.gang``) by the same accounting, whether the program communicates between the hosts
(an all-gather) or not (each host computes its rows alone): there, the completed steps follow
the weights too, though each tenant's client waits for every batch of 8 before it sends the next.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest

from pathways_nb.client.observe import Observer
from pathways_nb.core import tuning
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import python_script, wait_until
from pathways_nb.worker.gang import Turn
from pathways_nb.worker.share import FairShare

CLIENTS = Path(__file__).with_name("clients")
BUSY = CLIENTS / "share_busy_device.py"
BUSY_ACROSS_HOSTS = CLIENTS / "share_busy_island_of_two_hosts.py"


def _device_time(events, start: float, end: float) -> float:
    """Seconds of device time in [start, end] of ``execute`` events."""
    return sum(max(0.0, min(e.end, end) - max(e.start, start)) for e in events)


def _share_of_a_busy_island(cluster: LocalCluster, busy: Path, *args: str) -> dict:
    """Light's and heavy's device seconds on device 0 and completed steps while both were busy, and every event.

    A step is complete once every device of the island has run its part: a tenant's completed
    steps are its fewest executions on any one device.
    """
    run = uuid.uuid4().hex[:6]  # tenants of their own: the cluster may have served others named alike
    clients = {
        tenant: python_script(busy, cluster.address, cluster.token, f"{tenant}-{run}", str(weight), "15", *args)
        for tenant, weight in (("light", 1), ("heavy", 3))
    }
    try:
        for client in clients.values():
            assert client.stdout.readline().strip() == "ready", client.stderr.read()[-3000:]
        for client in clients.values():
            client.stdin.write("go\n")
            client.stdin.flush()
        dispatched = {}
        for tenant, client in clients.items():
            done, _, count = client.stdout.readline().strip().partition(" ")
            assert done == "done", client.stderr.read()[-3000:]
            dispatched[tenant] = int(count)
    finally:
        for client in clients.values():
            client.kill()
            client.communicate()
    observer = Observer(cluster.address, token=cluster.token)
    try:
        # Every program the clients ran has an execute event on each device, once the workers' last
        # events have reached the proxy.
        island = [device.id for device in observer.state().devices]

        def executions() -> dict[tuple[str, int], int]:
            ran = {
                t: [d for e in observer.events(tenant=f"{t}-{run}") if e.kind == "execute" for d in e.device_ids]
                for t in clients
            }
            return {(t, d): ran[t].count(d) for t in clients for d in island}

        wait_until(
            executions,
            30,
            f"an execute event on each device for each program the clients ran ({dispatched})",
            holds=lambda counts: all(counts[t, d] >= dispatched[t] for t, d in counts),
            interval_s=0.1,
        )
        events = {tenant: observer.events(tenant=f"{tenant}-{run}") for tenant in clients}
    finally:
        observer.close()
    # Each device's executions (on two hosts, each host reports its own part of a program).
    devices = sorted({d for evs in events.values() for e in evs if e.kind == "execute" for d in e.device_ids})
    executes = {
        (t, device): [e for e in evs if e.kind == "execute" and list(e.device_ids) == [device]]
        for t, evs in events.items()
        for device in devices
    }
    # While both were busy: from the later first execution to the earlier last one (device 0's).
    start = max(min(e.start for e in executes[t, 0]) for t in clients) + 1.0
    end = min(max(e.end for e in executes[t, 0]) for t in clients) - 1.0
    assert end - start > 8, (start, end)
    seconds = {t: _device_time(executes[t, 0], start, end) for t in clients}
    steps = {t: min(sum(start <= e.end <= end for e in executes[t, d]) for d in devices) for t in clients}
    # How busy the island's busiest device was (a slower host's keeps the others waiting).
    busy = max(sum(_device_time(executes[t, d], start, end) for t in clients) for d in devices) / (end - start)
    print(
        f"device time: heavy {seconds['heavy']:.2f} s, light {seconds['light']:.2f} s, "
        f"ratio {seconds['heavy'] / seconds['light']:.2f}, busy {busy:.2f}; completed steps: heavy "
        f"{steps['heavy']}, light {steps['light']}, ratio {steps['heavy'] / max(1, steps['light']):.2f}"
    )
    return {"seconds": seconds, "steps": steps, "busy": busy, "events": events}


def test_device_time_follows_the_weights_when_the_island_is_saturated():
    with LocalCluster(islands=1, devices_per_host=1) as cluster:
        share = _share_of_a_busy_island(cluster, BUSY)
    light, heavy = share["seconds"]["light"], share["seconds"]["heavy"]
    assert share["busy"] > 0.8, share  # the island was saturated
    # Weights 1:3 give 3; a scheduler that ignored them would give 1. Not tighter: the share is work-
    # conserving, so while a client starved of CPU (a loaded machine) has nothing queued the other runs
    # alone (3.35 seen beside another test run).
    assert 2.4 <= heavy / light <= 3.6, (heavy, light)
    # The waits for a turn are on the timeline too.
    assert any(e.kind == "wait" and e.name.endswith("waits its turn") for e in share["events"]["light"])


@pytest.fixture(scope="module")
def island_of_two_hosts():
    with LocalCluster(islands=1, hosts_per_island=2, devices_per_host=1) as cluster:
        yield cluster


@pytest.mark.parametrize(
    ("program", "most_steps"),
    [
        pytest.param("all-gather", 4.5, id="all-gather"),
        pytest.param("no collective", 3.75, id="no collective"),
        pytest.param("no collective, host 1 slower", 3.75, id="no collective, host 1 slower"),
    ],
)
def test_programs_across_hosts_follow_the_weights_whatever_they_communicate(island_of_two_hosts, program, most_steps):
    """Without a collective, host 1 runs its parts at its own pace: host 0's turns must wait for them too.

    Where host 1 is the slower (here made so: it does twice the work), counting host 0's parts alone
    let the client's own window decide, 1:1.
    """
    share = _share_of_a_busy_island(island_of_two_hosts, BUSY_ACROSS_HOSTS, program)
    seconds, steps = share["seconds"], share["steps"]
    assert share["busy"] > 0.5, share  # saturated (less than one host's worth: steps go in turn)
    # Weights 1 and 3: measured 2.7-3.4 in device time; in completed steps (the goal: 3 within 25%)
    # 3.1-3.5 without a collective, 3.2-4.0 with the all-gather. While a tenant that waits for its batch
    # counted as idle, the other ran ahead as if alone and the first came back level with it at every
    # batch: 1.6-2.2. (While host 0 counted its own part alone, a program with no collective got
    # 1.1-2.3; with host 1 slower, 0.9-1.1.) Steps spread more than device time: half the light tenant's
    # steps run while the heavy one's client and the servers handle its next batch, on the CPUs that
    # are the devices here, and an all-gather's then also waits longer for host 1 to hear its turn.
    assert 2.4 <= seconds["heavy"] / seconds["light"] <= 3.6, seconds
    assert 2.25 <= steps["heavy"] / steps["light"] <= most_steps, steps


@pytest.mark.parametrize(
    ("idle_after_s", "order"),
    [
        (60.0, ["heavy 0", "light 0", "heavy 1", "light 1", "light 2"]),  # heavy busy: one light ahead, then heavy
        (0.0, ["heavy 0", "light 0", "light 1", "light 2", "heavy 1"]),  # heavy idle at once: light runs 3 ahead
    ],
)
def test_a_tenant_waiting_for_its_results_keeps_its_place(idle_after_s, order):
    """A client that waits for its batch has nothing queued meanwhile: for ``SHARE_IDLE_AFTER_S`` it is not idle.

    Else the other tenant ran ``alone_depth`` programs ahead, and the first came back behind them all.
    """
    with tuning.SHARE_IDLE_AFTER_S.overridden(idle_after_s):
        share = FairShare(alone_depth=3)  # as an island's
    turns, started, heavy_ran = {}, [], threading.Event()

    def program(name):
        def dispatch():
            turns[name] = Turn()
            started.append(name)
            return [turns[name]]

        return dispatch

    try:
        share.submit("heavy", 3.0, program("heavy 0"), [0], lambda start, end, failed: heavy_ran.set())
        turns["heavy 0"].ran.resolve(None)
        assert heavy_ran.wait(10)  # its batch has run; its client has yet to send the next one
        for index in range(3):
            share.submit("light", 1.0, program(f"light {index}"))
        share.submit("heavy", 3.0, program("heavy 1"))
        for position in range(1, len(order)):  # each program runs in turn, in the order the share starts them
            wait_until(lambda position=position: len(started) > position, 10, f"program {position} to start")
            turns[started[position]].ran.resolve(None)
    finally:
        for turn in turns.values():
            turn.ran.resolve(None)
        share.close()
    assert started == order
