"""A small soak: several clients, mixed work, reconnects and a killed client; no wrong result, memory back."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import finish, long_callback_stalls, python_script, soak


def test_small_soak_has_no_wrong_results_and_memory_comes_back():
    with LocalCluster(islands=2, devices_per_host=2) as cluster:
        report = soak.run(cluster, clients=3, seconds=12)
        stalled = long_callback_stalls(cluster.loop_stats())
    print(report.table())
    assert not stalled, f"loops that ran a callback for more than 0.5 s: {stalled}"
    assert report.killed_ok, report.killed_note
    assert len(report.clients) == 2 and all(c["iterations"] > 0 and c["connects"] >= 1 for c in report.clients)
    assert report.wrong == 0, report.clients
    assert not report.errors, report.errors[:5]
    growth = report.memory_growth()
    assert set(growth) == {"resource-manager", "worker-0-0", "worker-1-0", "proxy"}
    assert all(ratio < 1.10 for ratio in growth.values()), report.table()


HANGS = Path(__file__).with_name("clients") / "hangs.py"


def test_a_client_that_hangs_is_reported_with_where_each_of_its_threads_was():
    """What the soak (and every test) does with a client past its time: abort it and show its stacks."""
    hung = python_script(HANGS)
    with pytest.raises(TimeoutError, match="did not finish within 2 s") as raised:
        finish(hung, timeout_s=2)
    stacks = str(raised.value)
    lines = HANGS.read_text().splitlines()
    waits, sleeps = lines.index("    threading.Event().wait()") + 1, lines.index("time.sleep(600)") + 1
    assert f'File "{HANGS}", line {waits} in wait_forever' in stacks, stacks  # the stuck thread
    assert f'File "{HANGS}", line {sleeps} in <module>' in stacks, stacks  # the main one
    assert hung.returncode == -signal.SIGABRT
