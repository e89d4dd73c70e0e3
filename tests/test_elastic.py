"""Google's pathwaysutils elastic training runs through a worker's death, as on Pathways on Cloud.

Its Manager health-checks each slice (island) with a small pmap and reads
DATA_LOSS errors as "slice down"; our cluster reports work and arrays lost with
a host that way, and fails them when their results are read. Training goes on
on the surviving island, and uses both again once the supervisor has brought
the worker back.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from pathways_nb.core.retry import Backoff
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import finish, python_script

CLIENTS = Path(__file__).with_name("clients")
TRAINING = CLIENTS / "elastic_training.py"
HEALTH_CHECKS = CLIENTS / "elastic_health_checks.py"


def test_elastic_manager_trains_through_a_worker_death():
    with LocalCluster(islands=2, devices_per_host=1) as cluster:
        client = python_script(TRAINING, cluster.address)
        try:
            assert json.loads(client.stdout.readline()) == {"slices": [0, 1]}
            assert json.loads(client.stdout.readline()) == {"kill": True}
            os.kill(cluster.workers[(1, 0)].process.pid, signal.SIGKILL)
            client.stdin.write("\n")
            client.stdin.flush()
            out, err = finish(client, 180)
        finally:
            client.kill()
        assert client.returncode == 0, err[-4000:]
        result = json.loads(out.splitlines()[-1])
        used = result["used"]
        # Both islands, then the survivor alone while the worker is down, then both again.
        assert used[:3] == [[0, 1]] * 3
        assert [0] in used, f"training never went on on the surviving island alone: {used[:8]}..."
        first_alone = used.index([0])
        assert all(u == [0] for u in used[first_alone : used.index([0, 1], first_alone)])
        assert used[-1] == [0, 1]
        assert any(e.name == "worker-1-0" and e.description == "killed by signal SIGKILL" for e in cluster.exits)
        assert "DATA_LOSS" in err


def test_programs_compile_for_an_island_that_is_down_and_run_once_it_is_back():
    """As on Pathways, compiling needs no live slice: pathwaysutils' health check compiles a program
    for every slice and counts one down when running it fails. A compile that failed instead made
    every check fail, and the elastic Manager retried without ever training on the survivors.
    """
    with LocalCluster(islands=2, devices_per_host=1) as cluster:
        cluster.supervisor.backoff = Backoff(first_s=600, max_s=600)  # island 1 stays down until the test restarts it
        client = python_script(HEALTH_CHECKS, cluster.address)
        try:
            assert json.loads(client.stdout.readline()) == {"active": [0, 1]}
            worker = cluster.workers[(1, 0)]
            old_pid = worker.process.pid
            cluster.kill_worker(1)
            client.stdin.write("\n")
            client.stdin.flush()
            down = json.loads(client.stdout.readline())
            assert down["active"] == [0], down
            assert down["run"].startswith("read failed: DATA_LOSS") and "island 1 host 0" in down["run"], down
            worker.relaunch(keep_port=False)
            cluster.wait_for_worker(1, 0, not_pid=old_pid)
            client.stdin.write("\n")
            client.stdin.flush()
            # The program compiled while island 1 was down runs on its new worker.
            assert json.loads(client.stdout.readline()) == {"active": [0, 1], "run": 5.0}
            _out, err = finish(client, 60)  # closes the client's stdin: it ends
            assert client.returncode == 0, err[-4000:]
        finally:
            client.kill()
