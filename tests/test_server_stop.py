"""How server processes end: on SIGTERM or SIGINT, however many arrive, and when their launcher dies.

A server that outlives the reason to run holds its port and devices forever, so these
run real servers as children and watch them go.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.launch.processes import ChildServer

PROXY = ["proxy", "--server_port", "0", "--devices", "1", "--log_level", "INFO"]


def _gone_within(pid: int, timeout_s: float) -> bool:
    try:
        psutil.Process(pid).wait(timeout_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_burst_of_signals_stops_a_server_once_and_cleanly(signum):
    """Signals in quick succession (a launcher and a supervisor both stopping it) end the server, never hang it."""
    server = ChildServer("proxy", PROXY)
    server.start()
    try:
        for gap_s in [0.0] * 10 + [0.0005 * k for k in range(1, 40)]:  # some arrive inside the first handler
            server.process.send_signal(signum)
            time.sleep(gap_s)
        assert server.process.wait(20) == 0, server.log_tail()
        assert "stopping on " + signal.Signals(signum).name in server.log()
    finally:
        server.close()


def test_a_server_stops_when_its_launcher_is_killed(tmp_path):
    """A launcher killed without stopping its children (SIGKILL, os._exit) takes its servers with it."""
    pid_file = tmp_path / "pid"
    launcher = Path(__file__).with_name("clients") / "starts_a_proxy_and_dies.py"
    subprocess.run([sys.executable, str(launcher), str(pid_file), *PROXY], check=False, timeout=120)
    pid = int(pid_file.read_text())
    assert _gone_within(pid, 15), f"the proxy (pid {pid}) outlived its launcher"
    assert not os.path.exists(f"/proc/{pid}") or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_hosts_of_an_island_stop_on_sigterm_not_sigkill():
    """A host of an island joins a JAX distributed runtime, whose preemption notifier takes SIGTERM and only
    notes it: the worker lived on until its launcher's SIGKILL (10 s later; a group's member, 5 s)."""
    cluster = LocalCluster(islands=1, hosts_per_island=2, devices_per_host=1).start()
    hosts = list(cluster.workers.values())
    cluster.close()  # SIGTERM to every process at once, SIGKILL to any still there 10 s later
    assert [host.process.returncode for host in hosts] == [0, 0], [host.log_tail() for host in hosts]
