"""The control plane works while the devices compute: a long program's dispatch is answered at once,
and uploads, reads and other programs are served while it runs, through the single-process proxy and
through a cluster's worker and across the hosts of a multi-host island. The same path serves every
program, long or small: ``benchmarks/parity.py`` measures its rate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import finish, python_script

SCRIPT = Path(__file__).with_name("clients") / "works_beside_a_long_program.py"


def run_beside_a_long_program(address: str, token: str, devices: int) -> dict:
    """The client's report (see the script), after checking what holds on every path."""
    process = python_script(SCRIPT, address, token, str(devices))
    out, err = finish(process, 300)
    assert process.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    # The dispatch is answered without waiting for the device; the work beside it is done long before the
    # long program ends (it would end after it if the server waited for the device in between).
    assert report["dispatched_s"] < 0.1 * report["alone_s"], report
    assert report["side_done_s"] < 0.5 * report["long_s"], report
    return report


def test_a_single_process_proxy_serves_requests_while_a_long_program_runs(proxy_server):
    report = run_beside_a_long_program(proxy_server.address, "", 1)
    assert report["small_programs"], report


def test_a_cluster_worker_serves_requests_while_a_long_program_runs(cluster):
    report = run_beside_a_long_program(cluster.address, cluster.token or "", 1)
    assert report["small_programs"], report


@pytest.fixture(scope="module")
def two_hosts():
    with LocalCluster(islands=1, hosts_per_island=2, devices_per_host=1) as cluster:
        yield cluster


def test_an_island_of_two_hosts_serves_requests_while_a_long_program_runs_across_them(two_hosts):
    report = run_beside_a_long_program(two_hosts.address, two_hosts.token, 2)
    assert report["hosts"] == [0, 1], report


def test_chained_steps_across_two_hosts_dispatched_back_to_back_never_wait_on_each_other(two_hosts):
    """Host 0 numbers the island's steps as their parts arrive; a step whose part was queued behind the
    island's in-flight limit could be numbered after one that the session sent later (the share's
    follower thread and the loop's thread each dispatched one), and the earlier step then waited for
    its own argument from the later one: this chain hung within 10-18 rounds of 16 steps, every time."""
    process = python_script(
        Path(__file__).with_name("clients") / "chains_across_two_hosts.py", two_hosts.address, two_hosts.token, "150"
    )
    out, err = finish(process, 240)
    assert process.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"rounds": 150, "equal": True}
