"""Shared fixtures: a single-process proxy, a 2-island LocalCluster, and one with colocated Python, each
started once per run.

Tests that take ``remote``/``local``/``both`` run against both backends: this
process connects to one, then the other, with two JAX backends at a time:
``proxy`` (the server's devices through the stock IFRT proxy client) and
``cpu`` (local), both with 4 devices, so each program runs on both and the
results are compared. On the cluster the 4 devices are island 1's (global ids
4-7, local ids 0-3 on their worker), so id translation is exercised too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import numpy as np
import pytest

import pathways_nb
from pathways_nb import testing
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.notebook import kernelspec

jax.config.update("jax_num_cpu_devices", 4)

# The stall guard fails a test whose servers' loops ran one callback for more than 0.5 s (docs/testing.md);
# pytester runs a test file that provokes it (tests/test_stall_guard.py).
pytest_plugins = ["pathways_nb.testing.stall_plugin", "pytester"]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes, not seconds (a full pip install); run by make test")


@pytest.fixture(scope="session")
def proxy_server(tmp_path_factory):
    storage_root = tmp_path_factory.mktemp("proxy-storage")
    with testing.proxy_process(4, "--host_buffer_timeout", "5", "--storage_root", str(storage_root)) as server:
        server.storage_root = str(storage_root)  # where its profiles and checkpoints go
        yield server


@pytest.fixture(scope="session")
def kernel_installed(tmp_path_factory):
    """The Pathways kernel installed under a temporary prefix that Jupyter searches."""
    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    kernelspec.install(prefix=str(prefix))
    previous = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(prefix / "share" / "jupyter"), previous]))
    yield prefix
    if previous is None:
        os.environ.pop("JUPYTER_PATH")
    else:
        os.environ["JUPYTER_PATH"] = previous


@pytest.fixture(scope="session")
def cluster():
    with LocalCluster(islands=2, devices_per_host=4) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def colocated_cluster():
    """2 islands of one host and 2 devices, running colocated Python (tests/test_colocated_*.py share it).

    Where this machine lets executors run as users of their own (root, and a Python other users can
    read), they do.
    """
    python = testing.other_users_python()
    with LocalCluster(islands=2, devices_per_host=2, colocated_python=True, colocated_python_executable=python) as c:
        yield c


@dataclass(frozen=True)
class Backend:
    name: str
    address: str
    device_slice: slice
    storage_root: str  # where the server writes what gs://BUCKET/PATH names


@pytest.fixture(scope="session", params=["single-process", "cluster"])
def backend(request) -> Backend:
    if request.param == "single-process":
        server = request.getfixturevalue("proxy_server")
        return Backend(request.param, server.address, slice(0, 4), server.storage_root)
    cluster = request.getfixturevalue("cluster")
    return Backend(request.param, cluster.address, slice(4, 8), cluster.storage_root)


@pytest.fixture(scope="session")
def connected(backend):
    connection = pathways_nb.connect(backend.address, timeout_s=30)
    yield connection
    pathways_nb.disconnect()


@pytest.fixture(scope="session")
def remote(connected, backend):
    """4 of the server's devices, as this process's ``proxy`` backend shows them."""
    return jax.devices("proxy")[backend.device_slice]


@pytest.fixture(scope="session")
def local(connected):
    """This process's own CPU devices, for computing the expected results."""
    return jax.devices("cpu")


def assert_same(remote_result, local_result) -> None:
    """Same pytree, dtypes, shapes and values (bitwise: both sides run the same XLA)."""
    remote_leaves, remote_tree = jax.tree.flatten(remote_result)
    local_leaves, local_tree = jax.tree.flatten(local_result)
    assert remote_tree == local_tree
    for got, want in zip(remote_leaves, local_leaves, strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        assert got.shape == want.shape, (got.shape, want.shape)
        np.testing.assert_array_equal(got, want)


@pytest.fixture
def both(remote, local):
    """``both(program)`` runs ``program(devices)`` on the server's devices and on local ones; results must match."""

    def run(program):
        with jax.default_device(remote[0]):
            remote_result = program(remote)
        with jax.default_device(local[0]):
            local_result = program(local)
        assert_same(remote_result, local_result)

    return run


@pytest.fixture
def magic(monkeypatch):
    """``%pathways`` in an IPython shell (no kernel), connected to what ``connected["session"]`` is set to."""
    from IPython.core.interactiveshell import InteractiveShell

    from pathways_nb.client import connection
    from pathways_nb.notebook import magics

    connected = {"session": None}
    monkeypatch.setattr(connection, "current", lambda: connected["session"])
    shell = magics.PathwaysMagics(InteractiveShell.instance())
    shell.connected = connected
    return shell
