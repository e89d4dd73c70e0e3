"""A client that disconnects or dies frees what it held; the server goes on serving others."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import psutil
import pytest

from pathways_nb import testing
from pathways_nb.client.observe import Observer

GIB = 1 << 30
CLIENTS = Path(__file__).with_name("clients")


def _client(address: str, script: str) -> subprocess.Popen:
    """The client ``script`` in a Python process whose JAX uses the server through the environment variables."""
    env = dict(
        JAX_PLATFORMS="proxy",
        JAX_BACKEND_TARGET=address,
        IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS="true",
        # These tests count the server's RSS, which maps uploads through shared memory without touching
        # them (tests/test_shared_memory.py checks that those mappings go with their arrays).
        PATHWAYS_SHARED_MEMORY="0",
    )
    return testing.python_script(CLIENTS / script, env=env)


def _rss(server) -> int:
    return psutil.Process(server.process.pid).memory_info().rss


@pytest.fixture(scope="module")
def server():
    with testing.proxy_process(2) as server:
        yield server


def test_disconnect_frees_the_clients_arrays(server):
    before = _rss(server)
    client = _client(server.address, "holds_a_gib.py")
    assert client.stdout.readline().strip() == "holding", client.stderr.read()[-2000:]
    holding = _rss(server)
    client.stdin.write("done\n")
    client.stdin.flush()
    assert holding - before > 0.9 * GIB
    assert client.wait(60) == 0
    # The 1 GiB of arrays (and their upload buffers) go back; compiler caches may stay.
    testing.wait_until(
        lambda: _rss(server),
        30,
        f"the server's RSS 0.9 GiB under its {holding} bytes while the client held its arrays (before: {before})",
        holds=lambda rss: holding - rss > 0.9 * GIB,
        interval_s=0.1,
    )


def test_client_killed_mid_upload(server, connected, remote):
    client = _client(server.address, "uploads_forever.py")
    assert client.stdout.readline().strip() == "started"
    # Killed while the server is receiving one of its uploads (the observe API lists it as under way).
    observer = Observer(server.address)

    def uploading() -> bool:
        assert client.poll() is None, client.stderr.read()[-2000:]
        return any(activity.kind == "upload" for activity in observer.state().activities)

    try:
        testing.wait_until(uploading, 60, "an upload under way", interval_s=0.01)
    finally:
        observer.close()
    client.send_signal(signal.SIGKILL)
    client.wait(10)
    with testing.WireSession(server.address) as other:
        assert other.session_id > 0
    assert server.process.poll() is None
    assert "Traceback" not in server.log()


def test_plain_environment_variables_run_a_program(server):
    client = _client(server.address, "sum_of_squares.py")
    out, err = client.communicate(timeout=120)
    assert client.returncode == 0, err[-3000:]
    assert out.split() == ["285.0", "2", "cpu"]


def test_plain_jax_is_untouched_by_the_plugin():
    started = time.monotonic()
    # A stale JAX_BACKEND_TARGET must not be dialled.
    client = testing.python_script(CLIENTS / "shows_devices.py", env={"JAX_BACKEND_TARGET": "grpc://127.0.0.1:1"})
    out, err = testing.finish(client, 60)
    assert client.returncode == 0, err
    assert json.loads(out)["platform"] == "cpu"
    assert "proxy" not in err
    assert time.monotonic() - started < 20


def test_jax_arrays_are_still_usable_locally(connected, local):
    with jax.default_device(local[0]):
        assert float(jax.jit(lambda x: x + 1)(np.float32(1))) == 2.0
