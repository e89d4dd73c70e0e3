"""The proxy's event loop never waits for a worker: one session's slow worker round trip holds up no one else.

Session A asks for something its island's worker must answer first (a program's cost
analysis; a reshard that the proxy does through its own memory, reading the array) while
that worker is stopped (SIGSTOP, shorter than the resource
manager's heartbeat time-out, so nothing is declared dead). Session B, on the
other island, meanwhile runs a program and reads its result: its requests are
served on the same event loop, and must not wait for A's answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from pathways_nb.client.observe import Observer
from pathways_nb.core import shared_memory
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.testing import python_process

# How long A's worker stays stopped at most: a stall shorter than 2.5 s is never a death anywhere (core.keepalive).
STOPPED_S = 2.0

SLOW = """
    import sys, jax, jax.numpy as jnp, numpy as np, pathways_nb
    pathways_nb.connect(sys.argv[1], tenant="slow", islands=[0])
    compiled = jax.jit(lambda a: jnp.tanh(a @ a)).lower(np.ones((64, 64), np.float32)).compile()
    print("ready", flush=True)
    sys.stdin.readline()
    print("asking", flush=True)
    costs = compiled.cost_analysis()                  # the worker answers this one
    costs = costs[0] if isinstance(costs, list) else costs
    print("flops", costs["flops"], flush=True)
"""

# Replicating an array sharded over both islands (an IFRT reshard, as pathwaysutils sends it): no
# worker holds all of it, so the proxy reads it.
SLOW_RESHARD = """
    import sys, jax, numpy as np, pathways_nb, pathwaysutils.reshard
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    pathways_nb.connect(sys.argv[1], tenant="slow")
    mesh = Mesh(np.array(jax.devices()), ("x",))      # island 0's device and island 1's
    a = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("x"))).block_until_ready()
    print("ready", flush=True)
    sys.stdin.readline()
    print("asking", flush=True)
    b = pathwaysutils.reshard.reshard(a, NamedSharding(mesh, P()))
    print("value", float(np.asarray(b)[5]), flush=True)
"""

PROMPT = """
    import sys, time, jax, numpy as np, pathways_nb
    pathways_nb.connect(sys.argv[1], tenant="prompt", islands=[1])
    step = jax.jit(lambda x: x * 2 + 1)
    x = jax.device_put(np.arange(8, dtype=np.float32), jax.devices()[0])
    step(x).block_until_ready()
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.perf_counter()
    value = float(step(x)[3])                         # execute, then read the result back
    print("served", time.perf_counter() - started, value, flush=True)
"""


def _line(process: subprocess.Popen) -> str:
    line = process.stdout.readline().strip()
    if not line:
        process.kill()
        raise AssertionError(f"the client ended early:\n{process.stderr.read()[-3000:]}")
    return line


def _requests_served(cluster: LocalCluster, tenant: str) -> int:
    """How many requests the proxy has served for ``tenant``'s session."""
    observer = Observer(cluster.address, token=cluster.token)
    try:
        return sum(s.requests for s in observer.state().sessions if s.tenant == tenant)
    finally:
        observer.close()


def _go(process: subprocess.Popen) -> None:
    process.stdin.write("go\n")
    process.stdin.flush()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("slow_code", "answer"), [(SLOW, "flops"), (SLOW_RESHARD, "value")], ids=["cost", "reshard"])
def test_a_stopped_worker_holds_up_only_the_session_that_waits_for_it(slow_code, answer):
    with LocalCluster(islands=2, devices_per_host=1) as cluster:
        slow = python_process(slow_code, cluster.address)
        prompt = python_process(PROMPT, cluster.address)
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
            deadline = stopped_at + STOPPED_S
            while _requests_served(cluster, "slow") == served:
                assert time.monotonic() < deadline, "A's request did not reach the proxy"
                time.sleep(0.01)
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
            for process in (slow, prompt):
                process.kill()
                process.communicate()


# The same 256 MiB upload, UPLOADS times in a row once told to go; then each one's start and end.
UPLOADS = 5
UPLOADER = """
    import json, sys, time, jax, numpy as np, pathways_nb
    pathways_nb.connect(sys.argv[1], tenant="uploader")
    big = np.ones(64 << 20, np.float32)                   # 256 MiB
    jax.device_put(big[:8], jax.devices()[0]).block_until_ready()
    print("ready", flush=True)
    sys.stdin.readline()
    times = []
    for _ in range(int(sys.argv[2])):
        started = time.time()
        jax.device_put(big, jax.devices()[0]).block_until_ready().delete()
        times.append((started, time.time()))
    print(json.dumps(times), flush=True)
"""

# Tiny programs until told to stop, then each one's start time and round trip.
TICKER = """
    import json, sys, threading, time, jax, numpy as np, pathways_nb
    pathways_nb.connect(sys.argv[1], tenant="ticker")
    step = jax.jit(lambda x: x + 1)
    x = jax.device_put(np.float32(1), jax.devices()[-1])     # not the uploader's device (nor its island)
    float(step(x))
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    ticks = []
    while not stop.is_set():
        started = time.time()
        float(step(x))
        ticks.append((started, time.time() - started))
    print(json.dumps(ticks), flush=True)
"""


@pytest.mark.timeout(240)
def test_a_large_upload_holds_up_no_other_session(backend):
    """A 256 MiB upload is put on its device off the proxy's event loop, so that another session's
    tiny programs (on another device) keep their pace meanwhile: the slowest round trip that overlaps
    an upload is a small fraction of the upload's time.

    Judged on the best of five uploads: a put on the loop holds up every one (a cluster's proxy
    writing the worker's file: 17-27% of each upload's time, beside a CPU hog or not), while off
    the loop the best stays under 6% even beside a hog, whose one-off stalls (0.58 s of one 1.06 s
    upload, once) hold up single uploads, not the verdict. The single-process proxy's CPU put costs
    next to nothing, so there this shows that the upload's arrival holds up no one."""
    # Over gRPC (as from another host): on this host the proxy would map the client's file, no copy.
    uploader = python_process(UPLOADER, backend.address, str(UPLOADS), env={shared_memory.ENABLE_ENV: "0"})
    ticker = python_process(TICKER, backend.address)
    try:
        assert _line(uploader) == "ready" and _line(ticker) == "ready"
        _go(uploader)
        uploads = json.loads(_line(uploader))
        _go(ticker)
        ticks = json.loads(_line(ticker))
    finally:
        for process in (uploader, ticker):
            process.kill()
            process.communicate()
    assert len(uploads) == UPLOADS
    # Per upload: the slowest tick that overlapped it (one the put held up would), and its time.
    held_up = [
        (
            max((took for start, took in ticks if start < ended and start + took > started), default=ended - started),
            ended - started,
        )
        for started, ended in uploads
    ]
    assert min(slowest / took for slowest, took in held_up) < 1 / 10, held_up
