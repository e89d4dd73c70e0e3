"""A worker forgets the programs no client can run any more, and only those.

A proxy in this process (with a compile cache of 2 programs) serves a real
cluster; real jax clients compile and destroy programs through it. What the
worker holds is read from the worker itself: a ``ProgramQuery`` for each id the
proxy ever gave a program answers NOT_FOUND once the worker forgot it. Ids are
the worker's names of programs, so those of two proxies must never meet.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.protocol.errors import RequestError
from pathways_nb.proxy.cluster_runtime import ClusterRuntime
from pathways_nb.proxy.context import ProxyLimits
from pathways_nb.proxy.rm_client import run_on_loop
from pathways_nb.proxy.server import ProxyServer
from pathways_nb.rpc import cluster_pb2 as pb
from pathways_nb.testing import python_script, wait_until

CLIENTS = Path(__file__).with_name("clients")
# Both clients compile the same program first (one compile, shared through the proxy's cache).
CLIENT = CLIENTS / "compiles_and_churns_programs.py"
KEEP = CLIENTS / "keeps_a_compiled_program.py"
EXPECTED = str([float(v * 3 + 1) for v in range(8)])
CACHE = 2


@pytest.fixture(scope="module")
def served():
    """A one-device cluster, and a proxy of this process serving it (so the test can read its ids)."""
    with LocalCluster(islands=1, devices_per_host=1) as cluster:
        runtime = ClusterRuntime(cluster.resource_manager.hostport, credentials=cluster.credentials)
        server = ProxyServer(runtime, limits=ProxyLimits(compile_cache_entries=CACHE), credentials=cluster.credentials)
        try:
            yield cluster, server, runtime
        finally:
            server.stop()


def _held(runtime: ClusterRuntime, first_id: int) -> set[int]:
    """The ids, of all this proxy gave out since ``first_id``, that the worker still holds."""
    device = next(d for d in run_on_loop(runtime.loop, runtime.cluster_state).wait(30).devices)
    last_id = next(runtime._program_ids)
    held = set()
    for program_id in range(first_id, last_id):
        command = pb.Command(program_query=pb.ProgramQuery(program=program_id))
        try:
            runtime.query(device, command, "program_query")
        except RequestError as error:
            assert "is not compiled on this worker" in error.message, error.message
            continue
        held.add(program_id)
    return held


def _settled(runtime: ClusterRuntime, first_id: int, done, timeout_s: float = 30) -> set[int]:
    """What the worker holds once ``done(held)`` (the client's destructs take a moment to arrive)."""
    return wait_until(
        lambda: _held(runtime, first_id), timeout_s, "the programs the worker holds settled", holds=done, interval_s=0.2
    )


def _client(cluster: LocalCluster, server: ProxyServer, churn: int):
    client = python_script(CLIENT, server.address, cluster.token, str(churn))
    assert client.stdout.readline().strip() == EXPECTED, client.stderr.read()[-3000:]
    assert client.stdout.readline().strip() == "churned", client.stderr.read()[-3000:]
    return client


def _ask(client, command: str) -> str:
    client.stdin.write(command + "\n")
    client.stdin.flush()
    return client.stdout.readline().strip()


def test_destroyed_programs_are_forgotten_and_programs_in_use_are_not(served):
    cluster, server, runtime = served
    first_id = next(runtime._program_ids)
    # Each client's first compile is the same program: the churner's is the keeper's (from the
    # proxy's compile cache) or, compiled again, the same executable on the worker under another id.
    keepers = first_id + 1
    keeper = _client(cluster, server, churn=0)
    churner = _client(cluster, server, churn=30)
    try:
        # 31 or 32 programs were compiled; the churner destroyed 30 of them. The worker keeps the
        # shared one and the 2 programs the proxy's compile cache still holds.
        held = _settled(runtime, first_id, lambda held: len(held) <= 2 + CACHE)
        assert keepers in held and len(held) <= 2 + CACHE, held
        # The churner's session ends: its handle goes, the keeper's stays and runs (no compile).
        churner.stdin.close()
        assert churner.wait(timeout=60) == 0, churner.stderr.read()[-3000:]
        held = _settled(runtime, first_id, lambda held: len(held) <= 1 + CACHE)
        assert keepers in held and len(held) <= 1 + CACHE, held
        before = next(runtime._program_ids)
        assert _ask(keeper, "run") == EXPECTED
        assert next(runtime._program_ids) == before + 1
        # Dropped by its last holder (and long out of the cache of 2): forgotten.
        assert _ask(keeper, "drop") == "dropped"
        held = _settled(runtime, first_id, lambda held: keepers not in held)
        assert keepers not in held and len(held) <= CACHE, held
        # Compiling it again after the worker forgot it works.
        assert _ask(keeper, "recompile") == EXPECTED
        assert _ask(keeper, "run") == EXPECTED
    finally:
        for client in (keeper, churner):
            client.kill()
            client.wait()
            for pipe in (client.stdin, client.stdout, client.stderr):
                pipe.close()


def test_two_proxies_programs_on_one_worker_stay_apart(served):
    """Each proxy names its programs on the workers; the names of two proxies never meet."""
    cluster, _server, _runtime = served
    servers = [
        ProxyServer(ClusterRuntime(cluster.resource_manager.hostport, credentials=cluster.credentials))
        for _ in range(2)
    ]
    clients = []
    try:
        for factor, server in zip((5, 7), servers, strict=True):
            clients.append(python_script(KEEP, server.address, cluster.token, str(factor)))
            expected = str([float(v * factor) for v in range(4)])
            assert clients[-1].stdout.readline().strip() == expected, clients[-1].stderr.read()[-3000:]
        for factor, client in zip((5, 7), clients, strict=True):
            assert _ask(client, "run") == str([float(v * factor) for v in range(4)])
    finally:
        for client in clients:
            client.kill()
            client.communicate()
        for server in servers:
            server.stop()
