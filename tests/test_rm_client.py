"""The proxy's one client of the resource manager (``proxy.rm_client``), against a real cluster.

A proxy of this process serves a cluster of two islands: however many sessions come and go, groups
form, hosts drain and operators ask for the cluster's state, it holds one channel to the resource
manager, and closes it when it stops. A resource manager that refuses the proxy's token answers
every call with a clear error, at once, never a hang.
"""

from __future__ import annotations

import time

import grpc
import pytest

from pathways_nb.core.events import EventLog
from pathways_nb.core.security import ClusterCredentials
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.protocol.errors import Code, RequestError
from pathways_nb.proxy.cluster_runtime import ClusterRuntime
from pathways_nb.proxy.rm_client import run_on_loop
from pathways_nb.proxy.server import ProxyServer
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.testing import wait_until


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(islands=2, devices_per_host=1) as cluster:
        yield cluster


def _on_loop(runtime: ClusterRuntime, make, timeout_s: float = 60):
    """What the coroutine ``make()`` returns, run on the proxy's loop (the test's thread waits, as a pool's would)."""
    return run_on_loop(runtime.loop, make).wait(timeout_s)


def _session_comes_and_goes(runtime: ClusterRuntime, session_id: int, islands: int) -> list[int]:
    """A session allocates devices (on the loop), then ends; the devices it had."""
    sink = EventLog().sink(f"tenant-{session_id}")

    async def open_and_end():
        attributes = {"pathways_islands": str(islands)} if islands >= 0 else {}
        session = await runtime.open_session(session_id, attributes, sink)
        devices = list(session.physical_device_ids)
        session.release()
        return devices

    return _on_loop(runtime, open_and_end)


def test_the_proxy_holds_one_channel_to_the_resource_manager_and_closes_it_when_it_stops(cluster):
    runtime = ClusterRuntime(cluster.resource_manager.hostport, credentials=cluster.credentials)
    server = ProxyServer(runtime, credentials=cluster.credentials)
    try:
        for session_id in range(1, 7):
            assert _session_comes_and_goes(runtime, session_id, session_id % 2)
        drained = _on_loop(runtime, lambda: runtime.drain(pb.DrainRequest(island=1)))
        assert drained.draining
        back = _on_loop(runtime, lambda: runtime.drain(pb.DrainRequest(island=1, undo=True)))
        assert not back.draining
        placement = runtime.group([0, 1]).wait(300)  # a group forms (its members start)
        assert len(placement.devices) == 2
        assert runtime.group([0, 1]).wait(10) == runtime.serving([0, 1])
        state = _on_loop(runtime, runtime.cluster_state)
        assert [g.group for g in state.groups] == ["0+1"]
        wait_until(lambda: not cluster.state().allocations, 30, "the sessions' allocations ended", interval_s=0.1)
        assert runtime.rm.channels_made == 1
        channel = runtime.rm._channel
        assert channel.get_state() == grpc.ChannelConnectivity.READY
    finally:
        server.stop()
    assert channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN
    assert runtime.rm.channels_made == 1
    with pytest.raises(RequestError, match="the proxy stopped"):
        runtime.rm.allocate(pb.AllocateRequest(num_devices=1))


def test_a_resource_manager_that_refuses_the_token_gives_a_clear_error_at_once(cluster):
    runtime = ClusterRuntime(cluster.resource_manager.hostport, credentials=ClusterCredentials(token="not-the-token"))
    try:
        started = time.monotonic()
        with pytest.raises(RequestError) as refused:
            _session_comes_and_goes(runtime, 1, -1)
        assert refused.value.code == Code.UNAUTHENTICATED, refused.value.message
        assert "token" in refused.value.message
        with pytest.raises(RequestError) as refused:
            _on_loop(runtime, runtime.cluster_state)
        assert refused.value.code == Code.UNAUTHENTICATED, refused.value.message
        assert time.monotonic() - started < 10  # refused, not retried until a deadline
        wait_until(lambda: runtime.watch_failure, 30, "the watch gave up on the refused token")
        assert runtime.watch_failure.code == Code.UNAUTHENTICATED
        assert not cluster.state().allocations
    finally:
        runtime.close()
    assert runtime.rm.closed and runtime.rm.channels_made == 1
