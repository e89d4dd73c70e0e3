"""Semantics JAX's own tests rely on, through the proxy and a cluster (each once a failure of JAX's test slice)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from jax._src import core
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_nb.core.convert import output_shardings
from pathways_nb.launch.local_cluster import LocalCluster
from pathways_nb.protocol import op_sharding, schema
from pathways_nb.testing import python_script

X = np.arange(64, dtype=np.float32).reshape(8, 8) / 7


def test_programs_make_take_and_return_tokens(both):
    def program(devices):
        x = jax.device_put(np.arange(8, dtype=np.int32), devices[0])
        made = jax.jit(jax.lax.create_token)(1.0)
        y, passed = jax.jit(lambda a, t: (a * 2, t))(x, made)
        captured = jax.jit(lambda a: (a + 2, made))(x)[1]
        for token in (made, passed, captured):
            assert isinstance(token, core.Token)
            token.block_until_ready()
            with pytest.raises(RuntimeError, match="Cannot convert a token-shape buffer to a numpy array"):
                np.asarray(token._buf)
        assert passed is not made
        return y

    both(program)


def test_device_put_onto_the_same_devices_in_another_order(both):
    def program(devices):
        first = Mesh(np.array(devices).reshape(2, 2), ("x", "y"))
        reversed_order = Mesh(np.array(devices[::-1]).reshape(2, 2), ("x", "y"))
        a = jax.device_put(X, NamedSharding(first, P("x", "y")))
        b = jax.device_put(a, NamedSharding(reversed_order, P("x")))  # jax reorders the shards (a remap)
        c = jax.device_put(b, NamedSharding(first, P(None, "x")))
        assert b.sharding == NamedSharding(reversed_order, P("x"))
        return a, b, c, jax.jit(lambda v: v * 2)(b)

    both(program)


def test_a_donated_argument_no_output_can_take_stays_alive(both):
    def program(devices):
        mesh = Mesh(np.array(devices[:2]), ("x",))
        x = jax.device_put(X[:, :2], NamedSharding(mesh, P("x")))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            y = jax.jit(lambda v: v @ v.T, donate_argnums=0)(x)
        assert not x.is_deleted()
        return x, y

    both(program)


def test_64_bit_values_keep_their_dtype(both):
    def program(devices):
        with jax.enable_x64(True):
            x = jax.device_put(np.arange(4, dtype=np.float64) / 3, devices[0])
            n = jax.jit(lambda v: v + 1)(jax.device_put(np.int64(2**40), devices[1]))
            assert x.dtype == np.float64 and n.dtype == np.int64
            return np.asarray(x), np.asarray(n), np.asarray(jax.numpy.linspace(0, 3, 5, dtype=np.float64))

    both(program)


def test_a_program_without_results_on_several_devices(remote, local):
    for devices in (remote, local):
        with jax.set_mesh(Mesh(np.array(devices[:2]), ("x",))):
            assert jax.jit(lambda: None)() is None


def test_an_unreduced_result_keeps_each_devices_partial_sum(both):
    def program(devices):
        mesh = Mesh(np.array(devices[:2]), ("x",), axis_types=(AxisType.Explicit,))
        with jax.set_mesh(mesh):
            x = jax.device_put(np.arange(8, dtype=np.float32), P("x"))
            partial = jax.lax.reduce_sum(x, [0], out_sharding=P(unreduced={"x"}))
            assert str(partial).startswith("Array(shape=(), dtype=float32, sharding=")
            shards = [shard.data for shard in partial.addressable_shards]
            return shards, jax.sharding.reshard(partial, P())

    both(program)


def test_devices_of_a_one_island_cluster_print_as_local_ones():
    with LocalCluster(islands=1, devices_per_host=2) as cluster:
        client = python_script(Path(__file__).with_name("clients") / "shows_devices.py", cluster.address)
        out, err = client.communicate(timeout=120)
    assert client.returncode == 0, err[-3000:]
    assert json.loads(out)["first"] == "CpuDevice(id=0)"


def test_unreduced_results_of_both_plain_sharding_formats_are_held_per_device():
    """V1 (type UNREDUCED) and V2 (an UNREDUCED subgroup): each device keeps a full-size partial value."""
    xla = schema.load().xla
    v1 = xla.OpSharding(type=op_sharding.UNREDUCED)
    v2 = xla.OpSharding(
        type=op_sharding.OTHER,
        tile_assignment_dimensions=[2, 2],
        tile_assignment_devices=[0, 1, 2, 3],
        last_tile_dims=[op_sharding.UNREDUCED],
    )
    replicated, split = output_shardings((v1.SerializeToString(), v2.SerializeToString()), (0, 1, 2, 3), 2)
    assert replicated.op_sharding is None
    assert split.shard_shape((8,)) == (4,)
    assert split.shard_indices((8,)) == ((slice(0, 4),),) * 2 + ((slice(4, 8),),) * 2
