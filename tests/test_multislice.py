"""One program across islands (multislice): a group of islands runs it as one SPMD program.

Stock clients against real clusters: two islands of two hosts of two devices for the programs, the
arrays, the training and the tenants; two islands of one host for a host's death and pathwaysutils'
elastic Manager. The clients are scripts under tests/clients/ (each says what it checks).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import finish, finished_ok, python_script

CLIENTS = Path(__file__).with_name("clients")


@pytest.fixture(scope="module")
def islands():
    """Two islands of two hosts of two devices: 8 devices, the hybrid mesh dcn 2 x ici 4."""
    with LocalCluster(islands=2, hosts_per_island=2, devices_per_host=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def pair():
    """Two islands of one host of two devices, for losing a host."""
    with LocalCluster(islands=2, devices_per_host=2) as cluster:
        yield cluster


def test_programs_over_two_islands_equal_local_jax_bit_for_bit(islands):
    """A psum over both axes of a hybrid mesh, an all-gather over its slow axis, a ppermute across islands;
    arrays from the host to both islands and back, between one island and both, outputs sharded across them."""
    checks = json.loads(finished_ok(python_script(CLIENTS / "multislice_equals_local.py", islands.address), 300))
    assert all(checks.values()), checks
    assert len(checks) == 9
    groups = islands.state().groups
    assert [(g.group, g.healthy, len(g.members)) for g in groups] == [("0+1", True, 4)]


def test_training_across_two_islands_has_local_jax_s_losses(islands):
    """Flax + Optax, data parallel over both islands for 30 steps: the losses of 8 local devices, to float32
    rounding (the gradient's sum across hosts adds in another order than one process does)."""
    out = finished_ok(python_script(CLIENTS / "multislice_training.py", islands.address, "30"), 300)
    losses = json.loads(out.splitlines()[-1])
    np.testing.assert_allclose(losses["remote"], losses["local"], rtol=1e-5)
    assert losses["remote"][-1] < losses["remote"][0] / 10


def test_tenants_mixing_one_and_two_island_programs_all_finish(islands):
    """Four tenants, each alternating programs over its island and over both, for 30 s: no deadlock, all right."""
    tenants = [
        python_script(CLIENTS / "multislice_tenant.py", islands.address, f"tenant-{i}", "30", str(i % 2))
        for i in range(4)
    ]
    try:
        reports = [json.loads(finished_ok(tenant, 240).splitlines()[-1]) for tenant in tenants]
    finally:
        for tenant in tenants:
            tenant.kill()
    for report in reports:
        assert report["wrong"] == [], report
        assert report["counts"]["one island"] > 0 and report["counts"]["two islands"] > 0, report


@pytest.mark.parametrize("mode", ["connect", "plain"])
def test_one_slice_lets_jax_make_mesh_span_islands(islands, mode):
    """By default each island is a slice (``jax.make_mesh`` refuses two, naming the hybrid mesh); a session of
    one slice (``connect(one_slice=True)``, or ``PATHWAYS_ONE_SLICE=1`` for a plain JAX program) runs a
    ``jax.make_mesh`` program over both islands, equal to local JAX, and its devices still name their island."""
    plain = {
        "JAX_PLATFORMS": "proxy,cpu",
        "JAX_BACKEND_TARGET": islands.address,
        "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS": "true",
        "PATHWAYS_ONE_SLICE": "1",
    }
    client = python_script(
        CLIENTS / "multislice_one_slice.py", islands.address, mode, env=plain if mode == "plain" else None
    )
    checks = json.loads(finished_ok(client, 300).splitlines()[-1])
    assert all(checks.values()) and len(checks) == (6 if mode == "connect" else 4), checks


def _next_report(client, wanted) -> dict:
    """The first line of a ``multislice_steps.py`` client for which ``wanted`` holds (an error if it ends first)."""
    for line in iter(client.stdout.readline, ""):
        report = json.loads(line)
        if wanted(report):
            return report
    raise AssertionError(f"the client ended: {client.stderr.read()[-3000:]}")


def test_a_dead_host_fails_its_group_s_work_with_data_loss_and_spares_the_other_island(pair):
    """A worker of island 1 SIGKILLed while a program runs on both islands: that work fails with DATA_LOSS
    naming the host, another session's programs on island 0 go on without an error, and once the island is
    back programs over both islands run again (the group forms again)."""
    both = python_script(CLIENTS / "multislice_steps.py", pair.address, "both", "0,1")
    alone = python_script(CLIENTS / "multislice_steps.py", pair.address, "alone", "0")
    try:
        assert both.stdout.readline().strip() == "ready" and alone.stdout.readline().strip() == "ready"
        reports: list[dict] = []  # island 0's session's, read as they come (a full pipe would stop it)
        reader = threading.Thread(target=lambda: reports.extend(json.loads(line) for line in alone.stdout))
        reader.start()
        old_pid = pair.workers[(1, 0)].process.pid
        killed = time.time()
        os.kill(old_pid, signal.SIGKILL)
        lost = _next_report(both, lambda report: "error" in report)
        assert time.time() - killed < 15, f"the loss was reported {time.time() - killed:.1f} s after the kill"
        assert lost["error"].startswith("DATA_LOSS") and "island 1 host 0" in lost["error"], lost
        pair.wait_for_worker(1, 0, not_pid=old_pid)
        back = _next_report(both, lambda report: report.get("ok"))
        finish(alone, 60)  # (closes its input: it ends)
        reader.join(60)
        assert reports and all(r.get("ok") for r in reports), [r for r in reports if not r.get("ok")][:3]
        during = [r for r in reports if killed < r["at"] < back["at"]]
        assert during, "island 0's session ran no step while island 1 was lost"
        finish(both, 60)
    finally:
        for client in (both, alone):
            client.kill()


def test_elastic_manager_drops_an_island_and_takes_it_back(pair):
    """pathwaysutils' Manager trains over both islands, on island 0 alone once island 1's worker is killed,
    and over both again once it is back: every step one program over the active islands."""
    client = python_script(CLIENTS / "multislice_elastic.py", pair.address)
    try:
        assert json.loads(client.stdout.readline()) == {"slices": [0, 1]}
        assert json.loads(client.stdout.readline()) == {"kill": True}
        os.kill(pair.workers[(1, 0)].process.pid, signal.SIGKILL)
        client.stdin.write("\n")
        client.stdin.flush()
        out, err = finish(client, 240)
    finally:
        client.kill()
    assert client.returncode == 0, err[-4000:]
    used = json.loads(out.splitlines()[-1])["used"]
    assert used[:3] == [[0, 1]] * 3
    assert [0] in used, f"training never went on on island 0 alone: {used[:8]}..."
    first_alone = used.index([0])
    assert all(u == [0] for u in used[first_alone : used.index([0, 1], first_alone)])
    assert used[-3:] == [[0, 1]] * 3
    assert "DATA_LOSS" in err
