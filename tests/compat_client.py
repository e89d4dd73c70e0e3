"""Ordinary JAX programs run by a stock JAX client of any version through a pathways-nb server.

Run as a script by a Python that has some jax (0.7.2 and newer) and no pathways-nb:
``python compat_client.py ADDRESS``. It registers the ``proxy`` backend as
pathwaysutils does, runs each program on the server's first 4 devices, checks the
result against numpy and prints one line per program as it finishes
(``PASS name seconds`` or ``FAIL name: error``), then ``DONE``. A client that aborts
(a CHECK in its C++) stops printing, so the last line names the program that
killed it. It imports only jax and numpy: newer and older clients run it alike.
"""

from __future__ import annotations

import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.backend import ifrt_proxy, register_backend_factory
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def _connect(address: str) -> list:
    register_backend_factory("proxy", lambda: ifrt_proxy.get_client(address, ifrt_proxy.ClientConnectionOptions()))
    jax.config.update("jax_platforms", "proxy")
    # Where pathways-nb is installed too, its jax plugin's factory replaces ours; both connect here.
    jax.config.update("jax_backend_target", address)
    devices = jax.devices()
    if len(devices) < 4:
        raise SystemExit(f"the server has {len(devices)} devices; these programs need 4")
    return devices[:4]


def _close(got, want, tolerance: float = 1e-5) -> None:
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tolerance, atol=tolerance)


X = np.arange(16, dtype=np.float32).reshape(4, 4) / 7


def jit(devices):
    x = jax.device_put(X, devices[0])
    _close(jax.jit(lambda a: jnp.sin(a) * 2 + 1)(x), np.sin(X) * 2 + 1)


def multiple_outputs(devices):
    x = jax.device_put(X, devices[0])
    total, product, maximum = jax.jit(lambda a: (a.sum(), a @ a, a.max(axis=0)))(x)
    _close(total, X.sum())
    _close(product, X @ X, 1e-4)
    _close(maximum, X.max(axis=0))


def scan(devices):
    def step(carry, value):
        carry = carry + value
        return carry, carry * 2

    final, stacked = jax.jit(lambda xs: jax.lax.scan(step, jnp.zeros(4, jnp.float32), xs))(
        jax.device_put(X, devices[0])
    )
    _close(final, X.sum(axis=0))
    _close(stacked, np.cumsum(X, axis=0) * 2)


def grad(devices):
    x = jax.device_put(X, devices[0])
    _close(jax.jit(jax.grad(lambda a: (a**3).sum()))(x), 3 * X**2, 1e-4)


def sharded_put_1d(devices):
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    x = jax.device_put(X, sharding)
    if len(x.addressable_shards) != 4 or x.addressable_shards[1].data.shape != (1, 4):
        raise AssertionError(f"shards {[s.data.shape for s in x.addressable_shards]}")
    _close(x, X)
    _close(x.addressable_shards[2].data, X[2:3])


def sharded_put_2d(devices):
    sharding = NamedSharding(Mesh(np.array(devices).reshape(2, 2), ("x", "y")), P("y", "x"))
    x = jax.device_put(X, sharding)
    _close(x, X)
    for shard in x.addressable_shards:
        _close(shard.data, X[shard.index])


def sharded_jit_reduction(devices):
    mesh = Mesh(np.array(devices).reshape(2, 2), ("x", "y"))
    x = jax.device_put(X, NamedSharding(mesh, P("x", "y")))
    out_sharding = NamedSharding(mesh, P("x"))
    rows = jax.jit(lambda a: (a * 2).sum(axis=1), out_shardings=out_sharding)(x)
    _close(rows, (X * 2).sum(axis=1), 1e-4)
    _close(jax.jit(jnp.sum)(x), X.sum(), 1e-4)
    replicated = jax.device_put(X, NamedSharding(mesh, P()))
    _close(jax.jit(lambda a, b: a @ b)(x, replicated), X @ X, 1e-4)


def donation(devices):
    x = jax.device_put(X, devices[0])
    y = jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    _close(y, X + 1)
    if not x.is_deleted():
        raise AssertionError("the donated argument was not deleted")
    try:
        np.asarray(x)
    except RuntimeError:
        return
    raise AssertionError("a donated argument could still be read")


def bf16(devices):
    x = jax.device_put(X.astype(jnp.bfloat16), devices[0])
    y = jax.jit(lambda a: a * 2 + 1)(x)
    _close(y, (X.astype(jnp.bfloat16) * 2 + 1).astype(jnp.bfloat16), 1e-2)


def device_to_device(devices):
    x = jax.device_put(X, devices[0])
    y = jax.device_put(x, devices[3])
    if y.devices() != {devices[3]}:
        raise AssertionError(f"copied onto {y.devices()}")
    _close(jax.jit(lambda a: a * 3)(y), X * 3, 1e-5)


def random(devices):
    with jax.default_device(devices[0]):
        key = jax.random.key(0) if hasattr(jax.random, "key") else jax.random.PRNGKey(0)
        got = jax.random.normal(key, (256,))
    values = np.asarray(got)
    if not (abs(values.mean()) < 0.3 and 0.7 < values.std() < 1.3):
        raise AssertionError(f"not normal: mean {values.mean()}, std {values.std()}")


def read_back(devices):
    big = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB: several chunks
    x = jax.device_put(big, devices[1])
    np.testing.assert_array_equal(np.asarray(x), big)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a[::2])(x)), big[::2])


PROGRAMS = (
    jit,
    multiple_outputs,
    scan,
    grad,
    sharded_put_1d,
    sharded_put_2d,
    sharded_jit_reduction,
    donation,
    bf16,
    device_to_device,
    random,
    read_back,
)


def main(address: str) -> int:
    devices = _connect(address)
    print(f"CLIENT jax {jax.__version__} devices {len(jax.devices())}", flush=True)
    failed = 0
    for program in PROGRAMS:
        started = time.monotonic()
        try:
            program(devices)
        except Exception as e:  # noqa: BLE001 - every program reports, whatever it raised
            failed += 1
            detail = "".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " | ")
            print(f"FAIL {program.__name__}: {detail[:2000]}", flush=True)
        else:
            print(f"PASS {program.__name__} {time.monotonic() - started:.2f}s", flush=True)
    print("DONE", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
