"""Fifty sessions on one proxy of a 2-island cluster: every one is served, fairly, and idle ones cost no CPU.

Wire-level sessions (``pathways_nb.testing.many_sessions``), coroutines of one client process, each
looping an upload, a program and a read for 10 s; ``benchmarks/sessions.py`` runs 200 for 60 s and
measures times.
"""

from __future__ import annotations

import pytest

from pathways_nb.testing import many_sessions

SESSIONS = 50
# The proxy's CPU time over 5 s, with every session open and idle, may exceed that with none by less
# than this (psutil counts CPU time in 10 ms ticks: 2 ms/s over the window). A session that polled,
# as one that held its allocation in a thread blocked on a gRPC stream did (ten wake-ups a second),
# cost ~0.4 ms/s each: 18 ms/s for fifty.
IDLE_CPU_PER_S = 0.006


@pytest.mark.timeout(600)
def test_fifty_sessions_are_all_served_fairly_and_idle_ones_cost_no_cpu(cluster):
    run = many_sessions.run(cluster.address, cluster.proxy.process.pid, SESSIONS, seconds=10, idle_window_s=5)
    assert run.errors == []
    assert run.served == SESSIONS, run.iterations
    # Measured 0.94-0.97 (slowest/median) on a loaded 2-core machine: the sessions take turns on one loop, so
    # what differs between them is the servers' doing. A session served a fraction of the others' rounds,
    # starved by a lock, an unfair queue or a charge it never works off, fails here.
    assert run.fairness >= 0.5, sorted(run.iterations)
    assert run.share(0.1) >= 0.7, sorted(run.iterations)
    assert run.proxy_cpu_idle - run.proxy_cpu_quiet < IDLE_CPU_PER_S, (run.proxy_cpu_quiet, run.proxy_cpu_idle)
