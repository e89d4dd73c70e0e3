"""A small soak: several clients, mixed work, reconnects and a killed client; no wrong result, memory back."""

from __future__ import annotations

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import soak


def test_small_soak_has_no_wrong_results_and_memory_comes_back():
    with LocalCluster(islands=2, devices_per_host=2) as cluster:
        report = soak.run(cluster, clients=3, seconds=12)
    print(report.table())
    assert report.killed_ok, report.killed_note
    assert len(report.clients) == 2 and all(c["iterations"] > 0 and c["connects"] >= 1 for c in report.clients)
    assert report.wrong == 0, report.clients
    assert not report.errors, report.errors[:5]
    growth = report.memory_growth()
    assert set(growth) == {"resource-manager", "worker-0-0", "worker-1-0", "proxy"}
    assert all(ratio < 1.10 for ratio in growth.values()), report.table()
