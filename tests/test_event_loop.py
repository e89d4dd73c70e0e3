"""No server's event loop ever waits: one session's slow work holds up no one else, and the watchdog says so.

Three views of it. A worker stopped (SIGSTOP) while one session waits for its answer: another session,
on another island, is served meanwhile by the same proxy loop. A 256 MiB upload to a worker: another
session's tiny programs on the same worker keep their pace. And everything at once on one cluster (big
uploads and tiny programs and new compiles on one worker, pathwaysutils' plugin programs, exclusive
sessions queued for an island): every server's loop watchdog (``core.loop``) then reports no stall in a
callback over 0.5 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pathways_nb.client.observe import Observer
from pathways_nb.core import shared_memory
from pathways_nb.core.security import TOKEN_ENV
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import finished_ok, long_callback_stalls, python_script, wait_until

CLIENTS = Path(__file__).with_name("clients")
# How long A's worker stays stopped at most: a stall shorter than 2.5 s is never a death anywhere (core.keepalive).
STOPPED_S = 2.0
# The longest a server's loop may spend in one callback (the watchdog notices from tuning's loop_stall_s).
LONGEST_STALL_S = 0.5
UPLOADS = 5
NO_SHARED_MEMORY = {shared_memory.ENABLE_ENV: "0"}  # over gRPC, as from another host: bytes through the loops


def _line(process: subprocess.Popen) -> str:
    line = process.stdout.readline().strip()
    if not line:
        process.kill()
        raise AssertionError(f"the client ended early:\n{process.stderr.read()[-3000:]}")
    return line


def _go(process: subprocess.Popen) -> None:
    process.stdin.write("go\n")
    process.stdin.flush()


def _requests_served(cluster: LocalCluster, tenant: str) -> int:
    """How many requests the proxy has served for ``tenant``'s session."""
    observer = Observer(cluster.address, token=cluster.token)
    try:
        return sum(s.requests for s in observer.state().sessions if s.tenant == tenant)
    finally:
        observer.close()


def _end(*processes: subprocess.Popen) -> None:
    for process in processes:
        process.kill()
        process.communicate()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("slow_client", "answer"),
    [("asks_island_0_for_costs.py", "flops"), ("replicates_across_islands.py", "value")],
    ids=["cost", "reshard"],
)
def test_a_stopped_worker_holds_up_only_the_session_that_waits_for_it(slow_client, answer):
    """Session A asks for something island 0's worker must answer first (a program's cost analysis; a reshard
    the proxy does through its own memory, reading the array) while that worker is stopped, for less than the
    resource manager's heartbeat time-out. Session B, on island 1, meanwhile runs a program and reads its
    result: served on the same proxy loop, it must not wait for A's answer."""
    with LocalCluster(islands=2, devices_per_host=1) as cluster:
        slow = python_script(CLIENTS / slow_client, cluster.address)
        prompt = python_script(CLIENTS / "one_step_on_island_1.py", cluster.address)
        worker = cluster.workers[(0, 0)].process
        resumed = threading.Event()  # set when the worker is let go: by the timer, or once B is served
        resume = threading.Timer(STOPPED_S, lambda: (resumed.set(), os.kill(worker.pid, signal.SIGCONT)))
        try:
            assert _line(slow) == "ready" and _line(prompt) == "ready"
            served = _requests_served(cluster, "slow")
            os.kill(worker.pid, signal.SIGSTOP)
            resume.start()
            stopped_at = time.monotonic()
            _go(slow)
            assert _line(slow) == "asking"
            # A's request is at the proxy, whose answer waits for the stopped worker.
            wait_until(
                lambda: _requests_served(cluster, "slow"),
                STOPPED_S,
                "A's request at the proxy",
                holds=lambda n: n > served,
            )
            _go(prompt)
            word, seconds, value = _line(prompt).split()
            # Served while A's worker was still stopped, not after it was let go.
            served_while_stopped = not resumed.is_set()
            resume.cancel()
            os.kill(worker.pid, signal.SIGCONT)
            assert word == "served" and float(value) == 7.0
            assert served_while_stopped, (seconds, time.monotonic() - stopped_at)
            word, number = _line(slow).split()
            assert word == answer and float(number) > 0  # flops, or element 5 of arange(8)
            assert answer != "value" or float(number) == 5.0
        finally:
            resume.cancel()
            os.kill(worker.pid, signal.SIGCONT)
            _end(slow, prompt)


def _slowest_tick_per_upload(uploads: list, ticks: list) -> list[tuple[float, float]]:
    """Per upload: the slowest tick that overlapped it (one the put held up would), and the upload's time."""
    return [
        (
            max(
                (took for start, took, *_ in ticks if start < ended and start + took > started), default=ended - started
            ),
            ended - started,
        )
        for started, ended in uploads
    ]


@pytest.mark.timeout(240)
def test_a_large_upload_holds_up_no_other_session_on_its_worker(backend):
    """A 256 MiB upload is put on its device off the proxy's loop and off its worker's, so that another
    session's tiny programs on another device of the same worker keep their pace meanwhile: the slowest
    round trip that overlaps an upload is a small fraction of the upload's time.

    Judged on the best of five uploads: a put on a loop holds up every one (a cluster's proxy writing the
    worker's file: 17-27% of each upload's time, beside a CPU hog or not), while off the loops the best stays
    under 6% even beside a hog, whose one-off stalls hold up single uploads, not the verdict. The
    single-process proxy's CPU put costs next to nothing, so there this shows that the upload's arrival holds
    up no one."""
    uploader = python_script(
        CLIENTS / "uploads_large_arrays.py", backend.address, str(UPLOADS), "0", env=NO_SHARED_MEMORY
    )
    ticker = python_script(CLIENTS / "ticks.py", backend.address, "1", "0")
    try:
        assert _line(uploader) == "ready" and _line(ticker) == "ready"
        _go(uploader)
        uploads = json.loads(_line(uploader))
        _go(ticker)
        ticks = json.loads(_line(ticker))
    finally:
        _end(uploader, ticker)
    assert len(uploads) == UPLOADS
    held_up = _slowest_tick_per_upload(uploads, ticks)
    assert min(slowest / took for slowest, took in held_up) < 1 / 10, held_up


@pytest.mark.timeout(600)
def test_no_loop_stalls_under_uploads_compiles_plugins_and_queued_sessions():
    """On one cluster at once: 256 MiB uploads and a ticker compiling a new program every few ticks on the same
    worker of island 0, pathwaysutils' profiling (plugin programs the proxy compiles) on island 0 too, and two
    tenants queued for island 1, which a third holds exclusively until the uploads are done. All of it
    finishes, and no server's loop (the resource manager's, the proxy's, each worker's) ran one callback for
    more than 0.5 s."""
    with LocalCluster(islands=2, devices_per_host=2) as cluster:
        # The token lets disconnect() end the session through the observe API.
        holder = python_script(
            CLIENTS / "holds_devices_exclusively.py", cluster.address, "1", env={TOKEN_ENV: cluster.token}
        )
        clients = [holder]
        try:
            assert _line(holder) == "holding"
            queued = [
                python_script(CLIENTS / "queues_for_an_island.py", cluster.address, f"queued-{i}") for i in (1, 2)
            ]
            clients += queued
            wait_until(
                lambda: {q.tenant for q in cluster.state().queue},
                120,
                "both tenants queued for island 1",
                holds=lambda t: t == {"queued-1", "queued-2"},
            )
            uploader = python_script(
                CLIENTS / "uploads_large_arrays.py", cluster.address, str(UPLOADS), "0", env=NO_SHARED_MEMORY
            )
            ticker = python_script(CLIENTS / "ticks.py", cluster.address, "1", "5")
            profiler = python_script(CLIENTS / "profiles_in_turn.py", cluster.address, cluster.storage_root)
            clients += [uploader, ticker, profiler]
            assert [_line(c) for c in (uploader, ticker, profiler)] == ["ready"] * 3
            _go(uploader)  # the ticker and the profiler are at work already
            uploads = json.loads(_line(uploader))
            _go(holder)  # releases island 1: the queued tenants get it in turn
            assert _line(holder) == "released"
            served = [finished_ok(q, 240).split() for q in queued]
            _go(ticker)
            _go(profiler)
            ticks = json.loads(_line(ticker))
            traces = int(_line(profiler))
            stats = cluster.loop_stats()
        finally:
            _end(*clients)
    assert len(uploads) == UPLOADS and traces >= 1
    assert served == [["served", "7.0"]] * 2
    assert sum(1 for *_, fresh in ticks if fresh) >= 3, "the ticker compiled too few new programs to tell"
    processes = [s.process for s in stats]
    assert {"resource manager", "proxy", "worker island0-host0", "worker island1-host0"} <= set(processes), processes
    stalled = long_callback_stalls(stats, LONGEST_STALL_S)
    assert not stalled, f"loops that ran a callback for more than {LONGEST_STALL_S} s: {stalled}"
