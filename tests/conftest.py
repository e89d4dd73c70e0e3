"""Shared fixtures: one proxy server subprocess for the whole run, and this process connected to it.

After ``connected`` this process has two JAX backends: ``proxy`` (the
server's devices, through the stock IFRT proxy client) and ``cpu`` (local),
each with 4 devices, so a test can run the same program on both and compare.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pathways_nb
from pathways_nb import testing

jax.config.update("jax_num_cpu_devices", 4)


@pytest.fixture(scope="session")
def proxy_server():
    with testing.proxy_process(4, "--host_buffer_timeout", "5") as server:
        yield server


@pytest.fixture(scope="session")
def connected(proxy_server):
    connection = pathways_nb.connect(proxy_server.address, timeout_s=30)
    yield connection
    pathways_nb.disconnect()


@pytest.fixture(scope="session")
def remote(connected):
    """The server's devices, as this process's ``proxy`` backend shows them."""
    return jax.devices("proxy")


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
