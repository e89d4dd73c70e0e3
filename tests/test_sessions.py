"""A client that disconnects or dies frees what it held; the server goes on serving others."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import psutil
import pytest

from pathways_nb import testing
from pathways_nb.client.observe import Observer

GIB = 1 << 30


def _client(address: str, body: str) -> subprocess.Popen:
    """A separate Python process whose JAX uses the server through the environment variables."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="proxy",
        JAX_BACKEND_TARGET=address,
        IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true",
        # These tests count the server's RSS, which maps uploads through shared memory without touching
        # them (tests/test_shared_memory.py checks that those mappings go with their arrays).
        PATHWAYS_SHARED_MEMORY="0",
    )
    code = "import jax, numpy as np, sys, time\n" + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _rss(server) -> int:
    return psutil.Process(server.process.pid).memory_info().rss


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.fixture(scope="module")
def server():
    with testing.proxy_process(2) as server:
        yield server


def test_disconnect_frees_the_clients_arrays(server):
    before = _rss(server)
    client = _client(
        server.address,
        """
        arrays = [jax.device_put(np.ones(256 * 1024 * 1024 // 4, np.float32) * i, jax.devices()[i % 2])
                  for i in range(4)]
        jax.block_until_ready(arrays)
        print("holding", flush=True)
        sys.stdin.readline()
    """,
    )
    assert client.stdout.readline().strip() == b"holding", client.stderr.read().decode()[-2000:]
    holding = _rss(server)
    client.stdin.write(b"done\n")
    client.stdin.flush()
    assert holding - before > 0.9 * GIB
    assert client.wait(60) == 0
    # The 1 GiB of arrays (and their upload buffers) go back; compiler caches may stay.
    assert _wait_for(lambda: holding - _rss(server) > 0.9 * GIB, 30), (before, holding, _rss(server))


def test_client_killed_mid_upload(server, connected, remote):
    client = _client(
        server.address,
        """
        print("started", flush=True)
        while True:
            jax.device_put(np.ones(512 * 1024 * 1024 // 4, np.float32), jax.devices()[0]).block_until_ready()
    """,
    )
    assert client.stdout.readline().strip() == b"started"
    # Killed while the server is receiving one of its uploads (the observe API lists it as under way).
    observer = Observer(server.address)
    deadline = time.monotonic() + 60
    try:
        while not any(activity.kind == "upload" for activity in observer.state().activities):
            assert time.monotonic() < deadline and client.poll() is None, client.stderr.read().decode()[-2000:]
            time.sleep(0.01)
    finally:
        observer.close()
    client.send_signal(signal.SIGKILL)
    client.wait(10)
    with testing.WireSession(server.address) as other:
        assert other.session_id > 0
    assert server.process.poll() is None
    assert "Traceback" not in server.log()


def test_plain_environment_variables_run_a_program(server):
    client = _client(
        server.address,
        """
        import jax.numpy as jnp
        x = jnp.arange(10.0)
        print(float(jax.jit(lambda v: (v ** 2).sum())(x)), len(jax.devices()), jax.devices()[0].platform)
    """,
    )
    out, err = client.communicate(timeout=120)
    assert client.returncode == 0, err.decode()[-3000:]
    assert out.decode().split() == ["285.0", "2", "cpu"]


def test_plain_jax_is_untouched_by_the_plugin():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["JAX_BACKEND_TARGET"] = "grpc://127.0.0.1:1"  # stale: must not be dialled
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cpu"
    assert "proxy" not in result.stderr
    assert time.monotonic() - started < 20


def test_jax_arrays_are_still_usable_locally(connected, local):
    with jax.default_device(local[0]):
        assert float(jax.jit(lambda x: x + 1)(np.float32(1))) == 2.0
