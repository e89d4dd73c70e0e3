"""Islands of several hosts: one SPMD program across worker processes, in one order, surviving a host's death.

The cluster has 2 islands of 2 hosts with 2 CPU devices each; the hosts of an
island form one JAX distributed runtime (collectives over gloo). Client
processes compare every result with the same program on 4 local CPU devices.
Values are small integers, so sums are exact whatever order a collective adds
them in.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from pathways_nb.client.observe import Observer
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.launch.processes import ChildServer
from pathways_nb.testing import finished_ok, python_script, wait_until

CLIENTS = Path(__file__).with_name("clients")
SPMD = CLIENTS / "multihost_spmd_equals_local.py"
COLLECTIVES = CLIENTS / "multihost_psums.py"
KILLED_HOST = CLIENTS / "multihost_killed_host.py"
MID_COLLECTIVE = CLIENTS / "multihost_killed_mid_collective.py"
CHAIN = CLIENTS / "multihost_chain.py"


@pytest.fixture(scope="module")
def two_by_two():
    with LocalCluster(islands=2, hosts_per_island=2, devices_per_host=2) as cluster:
        yield cluster


def _run(script: Path, *args: str, timeout_s: float = 240) -> dict:
    client = python_script(script, *args)
    out, err = client.communicate(timeout=timeout_s)
    assert client.returncode == 0, f"client failed:\n{out[-2000:]}\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def test_spmd_programs_across_hosts_equal_local_jax(two_by_two):
    report = _run(SPMD, two_by_two.address, two_by_two.token)
    assert report.pop("hosts") == [0, 1]
    assert report == dict.fromkeys(report, True) and len(report) == 11, report


def test_clients_of_two_proxies_interleave_collectives_without_deadlock(two_by_two):
    """Four clients on one 2-host island, through two proxies: every host runs their programs in one order."""
    second = ChildServer(
        "proxy-2",
        ["proxy", "--server_port", "0", "--resource_manager_address", two_by_two.resource_manager_address],
        env=two_by_two._child_env,
    )
    second.start(60)
    try:
        addresses = [two_by_two.address, second.address] * 2
        clients = [
            python_script(COLLECTIVES, address, two_by_two.token, f"tenant-{i}", str(10 * i), "20")
            for i, address in enumerate(addresses)
        ]
        results = []
        for client in clients:
            out, err = client.communicate(timeout=240)
            assert client.returncode == 0, err[-4000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        second.close()
    assert all(r["rounds"] > 0 and r["wrong"] == 0 for r in results), results


def test_a_dead_host_fails_its_island_clearly_and_the_island_forms_again(two_by_two):
    client = python_script(KILLED_HOST, two_by_two.address, two_by_two.token)
    try:
        assert json.loads(client.stdout.readline()) == {"value": 8.0}
        host0, host1 = two_by_two.workers[(1, 0)].process.pid, two_by_two.workers[(1, 1)].process.pid
        os.kill(host1, signal.SIGKILL)
        client.stdin.write("\n")
        client.stdin.flush()
        report = json.loads(client.stdout.readline())
        assert "DATA_LOSS" in report["island1"]["error"] and "island 1 host" in report["island1"]["error"]
        assert report["island0"] == {"value": 8.0}

        # Both hosts of the island are replaced: the island's runtime forms again.
        def formed_again(workers) -> bool:
            fresh = workers["island1-host0"].pid not in (host0, 0) and workers["island1-host1"].pid != host1
            return fresh and all(w.healthy for w in workers.values())

        wait_until(
            lambda: {w.worker_id: w for w in two_by_two.state().workers},
            60,
            "both hosts of island 1 replaced and every worker healthy",
            holds=formed_again,
            interval_s=0.1,
        )
        client.stdin.write("\n")
        client.stdin.flush()
        assert json.loads(client.stdout.readline()) == {"value": 8.0}
    finally:
        client.kill()
        client.communicate()


def test_a_host_killed_mid_collective_fails_programs_without_a_hang_and_the_island_serves_again(two_by_two):
    """The surviving host is inside collectives that wait for the dead one: errors come, not a hang."""
    client = python_script(MID_COLLECTIVE, two_by_two.address, two_by_two.token)
    try:
        assert client.stdout.readline().strip() == "running"
        os.kill(two_by_two.workers[(1, 1)].process.pid, signal.SIGKILL)
        out, err = client.communicate(timeout=150)
        assert client.returncode == 0, err[-4000:]
    finally:
        client.kill()
    outcomes = json.loads(out.strip().splitlines()[-1])
    errors = [o for o in outcomes if "error" in o]
    assert errors, "no program failed after the kill"
    assert all("DATA_LOSS" in o["error"] and "island 1 host" in o["error"] for o in errors), errors
    assert max(o["s"] for o in errors) < 30, errors  # each failure is reported, none hangs
    after = outcomes[outcomes.index(errors[-1]) + 1 :]
    workers = [(w.worker_id, w.healthy, w.incarnation, w.down_reason) for w in two_by_two.state().workers]
    assert len(after) >= 5 and all(o.get("ok") for o in after), (outcomes[-10:], workers)
    assert all(o.get("ok") for o in outcomes[:20]), outcomes[:20]


def test_a_long_chain_of_collectives_dispatched_back_to_back_finishes(two_by_two):
    """More than a couple of cross-host collectives in flight never finish on XLA's CPU runtime: workers bound them."""
    assert _run(CHAIN, two_by_two.address, two_by_two.token, timeout_s=120) == {"value": 1.0}


def _token(cluster: LocalCluster) -> dict[str, str]:
    return {"PATHWAYS_CLUSTER_TOKEN": cluster.token}


def test_draining_a_host_moves_a_two_host_session_to_another_island(two_by_two):
    """mover holds island 0 (2 hosts x 2 devices) with arrays laid over both hosts and a program that runs on both;
    draining island 0 host 1 moves the whole session to island 1's two hosts at the same host indices, where it
    goes on with every array bitwise equal, its program, a new one, and jax.devices() as they were."""
    wait_until(lambda: two_by_two.state().workers, 60, "every host healthy", holds=lambda w: all(x.healthy for x in w))
    observer = Observer(two_by_two.address, token=two_by_two.token)
    mover = python_script(
        CLIENTS / "moves_to_other_devices.py", two_by_two.address, "mover", "4", env=_token(two_by_two)
    )
    try:
        assert mover.stdout.readline().strip() == "ready"
        (session,) = [s for s in observer.state().sessions if s.tenant == "mover"]
        assert list(session.device_ids) == [0, 1, 2, 3]
        drained = observer.drain(0, 1)
        assert drained.draining and drained.drain_status.startswith("draining"), drained
        wait_until(
            lambda: next(w for w in observer.state().workers if (w.island, w.host_index) == (0, 1)).drain_status,
            60,
            "island 0 host 1 drained",
            holds="drained".__eq__,
        )
        mover.stdin.write("check\n")
        mover.stdin.flush()
        found = json.loads(mover.stdout.readline())
        assert all(found.values()), found
        wait_until(
            lambda: [(s.state, list(s.device_ids)) for s in observer.state().sessions if s.tenant == "mover"],
            30,
            "the session running on island 1",
            holds=[("running", [4, 5, 6, 7])].__eq__,
        )
        mover.stdin.write("done\n")
        mover.stdin.flush()
        finished_ok(mover, 60)
    finally:
        mover.kill()
        observer.drain(0, 1, undo=True)
        observer.close()
