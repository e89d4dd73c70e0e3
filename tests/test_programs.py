"""Ordinary JAX programs through the proxy give exactly what they give on local devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

X = np.arange(64, dtype=np.float32).reshape(8, 8) / 7

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.uint8, np.bool_, np.complex64]


def test_devices_look_like_local_ones(remote, local, backend):
    assert len(remote) == len(local) == 4
    assert {d.platform for d in remote} == {"cpu"}
    assert remote[0].device_kind == local[0].device_kind
    if backend.name == "single-process":
        assert [d.id for d in remote] == [d.id for d in local]
        assert [str(d) for d in remote] == [str(d) for d in local]
        assert [repr(d) for d in remote] == [repr(d) for d in local]
        assert remote[0].slice_index == 0
    else:
        assert [d.id for d in remote] == [4, 5, 6, 7]
        assert [str(d) for d in remote] == ["cpu:4", "cpu:5", "cpu:6", "cpu:7"]
        assert repr(remote[0]) == "CpuDevice(id=4, slice_index=1)"
        assert {d.slice_index for d in remote} == {1}
        assert [d.coords for d in remote] == [[0, i] for i in range(4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_put_and_read_back(both, dtype):
    value = (np.arange(24).reshape(4, 6) % 7).astype(dtype)
    both(lambda devices: jax.device_put(value, devices[2]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_jit_on_one_device(both, dtype):
    value = (np.arange(24).reshape(4, 6) % 7).astype(dtype)
    both(lambda devices: jax.jit(lambda a: a + a * a)(jax.device_put(value, devices[1])))


def test_scalar_round_trip(both):
    both(lambda devices: jax.jit(lambda a: a * 2)(jax.device_put(np.float32(3.5), devices[0])))


def test_sharded_put_and_replicated_put(both):
    def program(devices):
        mesh = Mesh(np.array(devices), ("x",))
        return jax.device_put(X, NamedSharding(mesh, P("x"))), jax.device_put(X, NamedSharding(mesh, P()))

    both(program)


def test_jit_on_a_2x2_mesh_with_several_outputs(both):
    def program(devices):
        mesh = Mesh(np.array(devices).reshape(2, 2), ("a", "b"))
        x = jax.device_put(X, NamedSharding(mesh, P("a", "b")))
        out = (NamedSharding(mesh, P("a")), NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "b")))
        return jax.jit(lambda a: (a @ a.T, jnp.sin(a).sum(), a.T * 2), out_shardings=out)(x)

    both(program)


def test_shard_map_with_collectives(both):
    def program(devices):
        mesh = Mesh(np.array(devices), ("x",))
        n = len(devices)

        def per_shard(a):
            return (
                jax.lax.psum(a, "x"),
                jax.lax.all_gather(a, "x"),
                jax.lax.ppermute(a, "x", [(i, (i + 1) % n) for i in range(n)]),
            )

        f = jax.shard_map(per_shard, mesh=mesh, in_specs=P("x"), out_specs=(P(), P(), P("x")), check_vma=False)
        return jax.jit(f)(jax.device_put(X, NamedSharding(mesh, P("x"))))

    both(program)


def test_donated_input_is_deleted(both):
    def program(devices):
        a = jax.device_put(X, devices[0])
        b = jax.jit(lambda v: v * 3, donate_argnums=0)(a)
        assert a.is_deleted()
        with pytest.raises(RuntimeError, match=r"deleted|donated"):
            np.asarray(a)
        return b

    both(program)


def test_grad_of_a_small_network(both):
    def program(devices):
        w = jax.device_put(np.full((8, 3), 0.1, np.float32), devices[0])
        x = jax.device_put(X, devices[0])
        return jax.grad(lambda w, x: jnp.tanh(x @ w).sum(), argnums=(0, 1))(w, x)

    both(program)


def test_random_numbers(both):
    def program(devices):
        key = jax.device_put(jax.random.key_data(jax.random.key(42)), devices[0])
        k1, k2 = jax.random.split(jax.random.wrap_key_data(key))
        return jax.random.normal(k1, (3, 4)), jax.random.uniform(k2, (5,)), jax.random.randint(k2, (6,), 0, 9)

    both(program)


def test_copy_between_devices(both):
    def program(devices):
        a = jax.device_put(X, devices[0])
        b = jax.device_put(a, devices[3])
        assert b.devices() == {devices[3]}
        return b

    both(program)


def test_reshard_to_other_shardings(both):
    def program(devices):
        mesh = Mesh(np.array(devices), ("x",))
        a = jax.device_put(X, NamedSharding(mesh, P("x")))
        b = jax.device_put(a, NamedSharding(mesh, P(None, "x")))
        c = jax.device_put(b, NamedSharding(mesh, P()))
        d = jax.device_put(c, devices[1])
        return a, b, c, d

    both(program)


def test_block_until_ready_and_delete(remote):
    a = jax.jit(lambda v: v @ v.T)(jax.device_put(X, remote[0]))
    assert a.block_until_ready() is a
    a.delete()
    assert a.is_deleted()
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(a)


def test_cost_analysis_and_program_text(remote, local):
    def compiled(devices):
        return jax.jit(lambda v: v @ v.T).lower(jax.device_put(X, devices[0])).compile()

    remote_compiled, local_compiled = compiled(remote), compiled(local)
    assert remote_compiled.cost_analysis()["flops"] == local_compiled.cost_analysis()["flops"]
    assert "dot" in remote_compiled.as_text()


def test_large_array_round_trip(remote):
    big = np.random.default_rng(0).random(64 * 1024 * 1024, dtype=np.float32)  # 256 MiB
    on_device = jax.device_put(big, remote[1])
    total = jax.jit(jnp.sum)(on_device)
    np.testing.assert_array_equal(np.asarray(on_device), big)
    np.testing.assert_allclose(float(total), float(big.astype(np.float64).sum()), rtol=1e-4)


def test_a_loop_of_steps_runs_ahead_and_matches(both):
    def program(devices):
        step = jax.jit(lambda w, x: w - 0.01 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w))
        w = jax.device_put(np.ones((8, 2), np.float32), devices[0])
        x = jax.device_put(X, devices[0])
        for _ in range(50):
            w = step(w, x)
        return w

    both(program)
