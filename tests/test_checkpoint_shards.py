"""A host's part of a checkpoint: TensorStore writes of the shards it holds, reads into any sharding."""

from __future__ import annotations

import datetime
import json

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.serialization import cloud_pathways_helper

from pathways_nb.core import persistence_requests as requests
from pathways_nb.protocol.errors import DeadlineExceeded, FailedPrecondition, NotFound, RequestError
from pathways_nb.worker import checkpoint_shards

HOSTS = {"host-a": (0, 1), "host-b": (2, 3)}  # two hosts of two devices each


def _devices():
    return jax.devices("cpu")[:4]


def _write_request(location: str, name: str, value: jax.Array, timeout_s: float = 60) -> requests.ArrayRequest:
    text = cloud_pathways_helper.get_bulk_write_request(
        location, [name], [value], datetime.timedelta(seconds=timeout_s)
    )
    ((key, body),) = json.loads(text).items()
    return requests.parse(key, body)[0]


def _read_request(location: str, name: str, dtype, shape, sharding: NamedSharding, timeout_s: float = 60):
    text = cloud_pathways_helper.get_bulk_read_request(
        location,
        [name],
        [np.dtype(dtype)],
        [shape],
        [sharding],
        sharding.mesh.devices,
        datetime.timedelta(seconds=timeout_s),
    )
    ((key, body),) = json.loads(text).items()
    return requests.parse(key, body)[0]


def _save_from_hosts(location: str, name: str, value: jax.Array) -> dict[str, int]:
    """Each host writes its part, as the workers do; returns the bytes each wrote."""
    array = _write_request(location, name, value)
    shards = {s.device.id: s.data for s in value.addressable_shards}
    return {
        host: checkpoint_shards.write(array, location, {d: shards[d] for d in ids}, value.dtype, host)
        for host, ids in HOSTS.items()
    }


def _restore_on_hosts(location: str, name: str, dtype, shape, sharding: NamedSharding) -> np.ndarray:
    array = _read_request(location, name, dtype, shape, sharding)
    devices = {d.id: d for d in _devices()}
    singles = {}
    for host, ids in HOSTS.items():
        mine = [d for d in array.sharding.device_ids if d in ids]
        singles.update(checkpoint_shards.read(array, location, mine, lambda v, d: jax.device_put(v, devices[d]), host))
    restored = jax.make_array_from_single_device_arrays(
        shape, sharding, [singles[d.id] for d in sharding._device_assignment]
    )
    return np.asarray(restored)


def test_each_region_is_written_once_and_reads_into_another_sharding(tmp_path):
    mesh = Mesh(np.array(_devices()).reshape(2, 2), ("a", "b"))
    value = np.arange(16 * 12, dtype=np.float32).reshape(16, 12)
    # Split along "b", replicated along "a": hosts a and b hold the same two halves.
    sharded = jax.device_put(value, NamedSharding(mesh, P(None, "b")))
    written = _save_from_hosts(str(tmp_path), "w", sharded)
    assert written == {"host-a": value.nbytes, "host-b": 0}
    zarray = json.loads((tmp_path / "w" / ".zarray").read_text())
    assert (zarray["chunks"], zarray["compressor"], zarray["dtype"]) == ([16, 6], {"id": "zstd", "level": 1}, "<f4")
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [".zarray", "0.0", "0.1"]
    other = NamedSharding(Mesh(np.array(_devices()[::-1]).reshape(4, 1), ("x", "y")), P("x", "y"))
    assert np.array_equal(_restore_on_hosts(str(tmp_path), "w", np.float32, (16, 12), other), value)


def test_reads_what_stock_orbax_saved_in_its_default_format_converting_the_dtype(tmp_path):
    mesh = Mesh(np.array(_devices()).reshape(4), ("a",))
    value = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"w": jax.device_put(value, NamedSharding(mesh, P("a")))})
    checkpointer.wait_until_finished()
    assert (tmp_path / "ckpt" / "manifest.ocdbt").exists()
    restored = _restore_on_hosts(str(tmp_path / "ckpt"), "w", ml_dtypes.bfloat16, (8, 8), NamedSharding(mesh, P()))
    assert np.array_equal(restored, value.astype(ml_dtypes.bfloat16))


def test_scalars_and_empty_arrays(tmp_path):
    mesh = Mesh(np.array(_devices()).reshape(4), ("a",))
    for name, value in [("scalar", np.float32(3.5)), ("empty", np.zeros((0, 4), np.int32))]:
        sharding = NamedSharding(mesh, P())
        _save_from_hosts(str(tmp_path), name, jax.device_put(value, sharding))
        assert np.array_equal(_restore_on_hosts(str(tmp_path), name, value.dtype, value.shape, sharding), value)


def test_failures_name_the_array_and_the_host(tmp_path):
    mesh = Mesh(np.array(_devices()).reshape(4), ("a",))
    value = jax.device_put(np.ones((8,), np.float32), NamedSharding(mesh, P("a")))
    late = _write_request(str(tmp_path), "late", value, timeout_s=1e-6)
    with pytest.raises(RequestError, match=r"writing array 'late' in .* on host-a: did not finish within") as raised:
        checkpoint_shards.write(late, str(tmp_path), {0: value.addressable_shards[0].data}, value.dtype, "host-a")
    assert raised.value.code == DeadlineExceeded.code
    sharding = NamedSharding(mesh, P("a"))
    missing = _read_request(str(tmp_path), "missing", np.float32, (8,), sharding)
    with pytest.raises(
        RequestError, match=r"reading array 'missing' in .* on host-b: .* holds no array 'missing'"
    ) as raised:
        checkpoint_shards.read(missing, str(tmp_path), [2], None, "host-b")
    assert raised.value.code == NotFound.code
    _save_from_hosts(str(tmp_path), "w", value)
    wrong = _read_request(str(tmp_path), "w", np.float32, (4, 2), NamedSharding(mesh, P("a")))
    with pytest.raises(RequestError, match=r"holds an array of shape \[8\], the restore asks for \[4, 2\]") as raised:
        checkpoint_shards.read(wrong, str(tmp_path), [0], None, "host-a")
    assert raised.value.code == FailedPrecondition.code
