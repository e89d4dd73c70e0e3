"""User Python beside the devices: ``jax.experimental.colocated_python`` on a 2-island cluster.

The stock client runs in a child process (its JAX must talk to this cluster only); each test
sends it a script and reads what it prints as JSON.
"""

from __future__ import annotations

import json

import pytest

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import python_process

CLIENT_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def colocated_cluster():
    with LocalCluster(islands=2, devices_per_host=2, colocated_python=True) as cluster:
        yield cluster


def run_client(cluster: LocalCluster, body: str, *args: str) -> dict:
    """Runs ``body`` connected to ``cluster`` in a new process; returns the JSON it printed last."""
    code = (
        "import json, sys, jax, numpy as np, pathways_nb\n"
        "from jax.experimental import colocated_python as cp\n"
        "pathways_nb.connect(sys.argv[1], token=sys.argv[2])\n" + body
    )
    process = python_process(code, cluster.address, cluster.token, *args)
    out, err = process.communicate(timeout=CLIENT_TIMEOUT_S)
    assert process.returncode == 0, f"client failed:\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def test_each_device_has_a_colocated_cpu_device_and_jax_devices_is_unchanged(colocated_cluster):
    result = run_client(
        colocated_cluster,
        """
devices = jax.devices()
cpus = cp.colocated_cpu_devices(devices)
x = jax.device_put(np.arange(6.0), devices[3])
on_cpu = jax.device_put(x, cpus[3])
back = jax.device_put(on_cpu * 2, devices[3])
print(json.dumps({
    "devices": [d.id for d in devices], "local_count": jax.local_device_count(),
    "kinds": sorted({d.device_kind for d in devices}),
    "cpus": [d.id for d in cpus], "cpu_kinds": sorted({d.device_kind for d in cpus}),
    "pairs": [[d.colocation_id, c.colocation_id] for d, c in zip(devices, cpus)],
    "islands": [c.slice_index for c in cpus],
    "on_cpu": [d.id for d in on_cpu.devices()], "back": np.asarray(back).tolist(),
}))
""",
    )
    assert result["devices"] == [0, 1, 2, 3] and result["local_count"] == 4
    assert result["kinds"] == ["cpu accelerator"]
    assert result["cpus"] == [4, 5, 6, 7] and result["cpu_kinds"] == ["cpu"]
    assert all(a == b for a, b in result["pairs"])
    assert result["islands"] == [0, 0, 1, 1]
    assert result["on_cpu"] == [7]
    assert result["back"] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
