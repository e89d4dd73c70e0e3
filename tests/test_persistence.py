"""Orbax checkpoints through pathwaysutils persistence: the workers write and read, the client never holds the arrays.

Each client is a stock JAX process as a Pathways on Cloud training script runs it:
``JAX_PLATFORMS=proxy``, ``ENABLE_PATHWAYS_PERSISTENCE=1``, ``pathwaysutils.initialize()``, Orbax's
``StandardCheckpointer``; the cluster has 2 islands x 2 CPU devices, and arrays are sharded over
all four. Checkpoints are ordinary Orbax checkpoints: a plain ``JAX_PLATFORMS=cpu`` process restores
them with stock Orbax, and the cluster restores what such a process saved.
"""

from __future__ import annotations

import glob
import json
import os
import re
import select
import signal
import subprocess
from pathlib import Path

import pytest

from pathways_nb import testing
from pathways_nb.client.observe import Observer
from pathways_nb.launch.local_cluster import LocalCluster

# The clients: tests/clients/orbax_*.py, with the tree every test saves in orbax_tree.py.
CLIENTS = Path(__file__).with_name("clients")


def _errors(stderr: str) -> str:
    """A failed process's Python traceback, without the stock client's C++ stack dumps."""
    return "\n".join(line for line in stderr.splitlines() if line.strip() and not line.startswith("\t"))[-5000:]


def _client_process(server, script: str, *args: str) -> subprocess.Popen:
    """A stock JAX client of ``server`` (a cluster or a proxy) running the client ``script``, as a Pathways
    on Cloud training script runs."""
    env = {
        "JAX_PLATFORMS": "proxy",
        "JAX_BACKEND_TARGET": server.address,
        "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS": "true",
        "ENABLE_PATHWAYS_PERSISTENCE": "1",
    }
    return testing.python_script(CLIENTS / script, *args, env=env)


def _json_lines(process: subprocess.Popen) -> list[dict]:
    """The JSON lines a client printed, once it has ended well."""
    out, err = testing.finish(process, 300)
    assert process.returncode == 0, _errors(err)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _client(server, script: str, *args: str) -> list[dict]:
    """Runs the client ``script`` against ``server`` (a cluster or a proxy); the JSON lines it printed."""
    return _json_lines(_client_process(server, script, *args))


def _next_json(client: subprocess.Popen, timeout_s: float = 240) -> dict:
    """The next JSON line the client prints; fails with its errors if it ends or takes longer."""

    def json_line() -> dict | None:
        if not select.select([client.stdout], [], [], 0)[0]:
            return None
        line = client.stdout.readline()
        if not line:
            raise EOFError("the client ended")
        return json.loads(line) if line.startswith("{") else None

    try:
        return testing.wait_until(json_line, timeout_s, "a JSON line from the client")
    except (TimeoutError, EOFError) as ended:
        client.kill()
        raise AssertionError(f"the client printed no result ({ended}):\n{_errors(client.communicate()[1])}") from None


def _local(script: str, *args: str) -> list[dict]:
    """Runs the client ``script`` in plain local JAX (4 CPU devices, stock Orbax, no pathways-nb); its JSON lines."""
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"}
    return _json_lines(testing.python_script(CLIENTS / script, *args, env=env))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("storage")
    with LocalCluster(islands=2, devices_per_host=2, storage_root=root) as cluster:
        yield cluster


def _moved_bytes(cluster: LocalCluster, start: float, end: float) -> int:
    """Bytes the proxy carried between a client and the devices (uploads, downloads) in [start, end]."""
    observer = Observer(cluster.address, cluster.token)
    try:
        return sum(e.bytes for e in observer.events() if e.kind in ("upload", "download") and start <= e.start <= end)
    finally:
        observer.close()


def test_orbax_saves_and_restores_through_the_workers(cluster, tmp_path):
    path = os.path.join(cluster.storage_root, "run", "step_1")
    saved, same_mesh, other_mesh, from_metadata = _client(
        cluster, "orbax_save_and_restore.py", path, str(tmp_path / "x.npz")
    )
    assert saved["runtime_type"] == "proxy/pathways" and saved["handler"] == "CloudPathwaysArrayHandler"
    everything = {"w": True, "b": True, "steps": True, "key": True}
    assert same_mesh["same mesh"] == everything
    assert other_mesh["other mesh"] == everything and other_mesh["on"] == [2, 3]
    assert from_metadata["from metadata"] == everything
    # The arrays (1.3 MiB) never passed through the proxy, nor grew the client's memory.
    assert _moved_bytes(cluster, *saved["save"]) < 16 << 10
    assert saved["peak_growth_kib"] < 1024
    files = sorted(os.listdir(path))
    assert {"_METADATA", "_CHECKPOINT_METADATA", "w", "b", "steps", "key", "array_metadatas"} <= set(files), files
    assert sorted(os.listdir(os.path.join(path, "w"))) == [".zarray", "0.0", "0.1", "1.0", "1.1"]
    assert sorted(os.listdir(os.path.join(path, "steps"))) == [".zarray", "0.0"]  # replicated: written once


def test_checkpoints_are_ordinary_orbax_checkpoints_both_ways(cluster):
    everything = {"w": True, "b": True, "steps": True, "key": True}
    # Saved through the cluster, restored by stock Orbax in plain local JAX.
    through_cluster = os.path.join(cluster.storage_root, "proof", "cluster")
    _client(cluster, "orbax_save.py", through_cluster, json.dumps({"use_ocdbt": False}))
    assert _local("orbax_restore.py", through_cluster) == [{"same": everything}]
    # Saved by stock Orbax in plain local JAX (its default format: OCDBT), restored through the cluster.
    saved_locally = os.path.join(cluster.storage_root, "proof", "local")
    _local("orbax_save.py", saved_locally, "{}")
    assert os.path.exists(os.path.join(saved_locally, "manifest.ocdbt"))
    assert _client(cluster, "orbax_restore.py", saved_locally) == [{"same": everything}]


def test_a_saved_array_stays_until_written_when_the_next_step_donates_it_or_the_client_drops_it(cluster):
    (result,) = _client(cluster, "orbax_donate_and_drop.py", os.path.join(cluster.storage_root, "held"))
    assert result == {"stepped": True, "donated": True, "dropped": True}


def test_places_outside_the_storage_root_and_timeouts_are_refused_clearly(cluster, tmp_path):
    root = cluster.storage_root
    outside, elsewhere = tmp_path / "outside", tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, os.path.join(root, "escape"))
    dotdot = os.path.join(root, "run", "..", "..", "x")
    paths = [str(outside / "ckpt"), dotdot, os.path.join(root, "escape", "ckpt"), os.path.join(root, "slow")]
    (outcomes,) = _client(cluster, "orbax_refused_places.py", *paths)
    assert "PERMISSION_DENIED" in outcomes["outside"] and "outside this server's storage root" in outcomes["outside"]
    assert "INVALID_ARGUMENT" in outcomes["dotdot"] and "'..'" in outcomes["dotdot"]
    assert "PERMISSION_DENIED" in outcomes["symlink"] and "symbolic link" in outcomes["symlink"]
    assert "DEADLINE_EXCEEDED" in outcomes["timeout"], outcomes["timeout"]
    assert re.search(r"writing array '\w+' in .*slow.* on island \d host 0: did not finish", outcomes["timeout"])
    # Nothing of an array reached a place outside the root (the client's own metadata files may have).
    written = [p for place in (outside, elsewhere) for p in place.rglob("*") if p.name in (".zarray", "0", "0.0")]
    assert not written, written


def test_a_worker_killed_mid_save_fails_it_with_data_loss_and_the_next_save_works(cluster):
    directory = os.path.join(cluster.storage_root, "killed")
    client = _client_process(cluster, "orbax_worker_killed_mid_save.py", directory)
    try:
        assert _next_json(client) == {"saving": 2}
        worker = cluster.workers[(1, 0)].process
        # Killed as soon as its first file of the 256 MiB appears, long before it can have written them all.
        testing.wait_until(
            lambda: glob.glob(f"{directory}/2.orbax-checkpoint-tmp*/**/big/*", recursive=True),
            120,
            "a first file of step 2's 256 MiB",
            interval_s=0.005,
        )
        os.kill(worker.pid, signal.SIGKILL)
        outcome = _next_json(client)
        assert "DATA_LOSS" in outcome["failure"] and "island 1 host 0" in outcome["failure"], outcome
        assert outcome["steps"] == [1]  # the half-written step 2 is no checkpoint
        assert glob.glob(f"{directory}/2.orbax-checkpoint-tmp*")
        cluster.wait_for_worker(1, 0, timeout_s=120, not_pid=worker.pid)
        client.stdin.write("\n")
        client.stdin.flush()
        assert _next_json(client) == {"steps": [1, 3], "restored": True}
    finally:
        client.kill()
        client.communicate()


def test_a_restore_counts_against_the_session_device_quota_before_reading(tmp_path):
    """On the single-process proxy, which runs the hosts' part itself."""
    quota = ("--session_device_bytes", str(6 << 20), "--storage_root", str(tmp_path))
    with testing.proxy_process(4, *quota) as server:
        (result,) = _client(server, "orbax_restore_over_quota.py", str(tmp_path / "ckpt"))
    assert "RESOURCE_EXHAUSTED" in result["over"] and "--session_device_bytes" in result["over"], result
    assert result["after"]
