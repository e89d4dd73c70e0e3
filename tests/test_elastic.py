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

from pathways_nb.core.retry import Backoff
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import finish, python_process

TRAINING = """
    import json, sys, jax, jax.numpy as jnp, numpy as np, pathways_nb
    from pathwaysutils.elastic import manager as elastic

    pathways_nb.connect(sys.argv[1], tenant="elastic")
    mgr = elastic.Manager()
    print(json.dumps({"slices": sorted(mgr.active_slice_indices)}), flush=True)
    step = jax.jit(lambda w, x: w - 0.1 * (w * x - 1.0) * x)    # SGD on (w x - 1)^2 / 2
    state = {"w": 0.0, "steps": 0, "used": [], "killed": False}

    @mgr.elastic_retry(minimum_slice_count=1, poll_interval=0.5, timeout=60)
    def train():
        slices = sorted(mgr.active_slice_indices)
        while True:
            if state["steps"] == 3 and not state["killed"]:
                state["killed"] = True
                print(json.dumps({"kill": True}), flush=True)
                sys.stdin.readline()                              # the test kills island 1's worker
            if mgr.available_inactive_slices:
                raise elastic.ScaleUpSignalError("a slice came back")
            # Data parallel: each active slice takes its shard of the batch; the host averages.
            updates = [
                step(jax.device_put(np.float32(state["w"]), mgr.slice_to_devices[i][0]),
                     jax.device_put(np.float32(1.0 + i), mgr.slice_to_devices[i][0]))
                for i in slices
            ]
            state["w"] = float(np.mean([np.asarray(u) for u in updates]))
            state["steps"] += 1
            state["used"].append(slices)
            # Done once both islands serve again after the survivor trained alone (or, if it never
            # did, after enough steps for the assertions to say so instead of training forever).
            if state["used"][-3:] == [[0, 1]] * 3 and ([0] in state["used"] or len(state["used"]) > 100):
                return state

    print(json.dumps(train()), flush=True)
"""


def test_elastic_manager_trains_through_a_worker_death():
    with LocalCluster(islands=2, devices_per_host=1) as cluster:
        client = python_process(TRAINING, cluster.address)
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


HEALTH_CHECKS = """
    import json, sys, jax, numpy as np, pathways_nb
    from pathwaysutils.elastic import elastic

    pathways_nb.connect(sys.argv[1], tenant="checks")
    slices = elastic.get_slice_to_devices(jax.devices())
    fresh = jax.jit(lambda x: x * 3 - 1)

    def report():
        try:
            active = sorted(elastic.get_active_slice_indices(slices))
        except Exception as error:                                # pathwaysutils counts no slice down here
            active = f"the health check failed: {type(error).__name__}: {error}"
        try:
            result = fresh(jax.device_put(np.float32(2), slices[1][0]))
        except Exception as error:
            return {"active": active, "run": f"dispatch failed: {type(error).__name__}: {error}"}
        try:
            return {"active": active, "run": float(result)}
        except jax.errors.JaxRuntimeError as error:
            return {"active": active, "run": f"read failed: {error}"}

    print(json.dumps({"active": sorted(elastic.get_active_slice_indices(slices))}), flush=True)
    for line in sys.stdin:                                        # the test kills island 1, then brings it back
        print(json.dumps(report()), flush=True)
"""


def test_programs_compile_for_an_island_that_is_down_and_run_once_it_is_back():
    """As on Pathways, compiling needs no live slice: pathwaysutils' health check compiles a program
    for every slice and counts one down when running it fails. A compile that failed instead made
    every check fail, and the elastic Manager retried without ever training on the survivors.
    """
    with LocalCluster(islands=2, devices_per_host=1) as cluster:
        cluster.supervisor.backoff = Backoff(first_s=600, max_s=600)  # island 1 stays down until the test restarts it
        client = python_process(HEALTH_CHECKS, cluster.address)
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
