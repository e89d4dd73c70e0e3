"""Orbax's persistence requests, as its own helper writes them, are read exactly; malformed ones get clear errors."""

from __future__ import annotations

import base64
import datetime
import json

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.serialization import cloud_pathways_helper

from pathways_nb.core import persistence_requests as requests
from pathways_nb.protocol.errors import InvalidRequest


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("a", "b"))


def test_a_write_request_as_orbax_sends_it():
    mesh = _mesh()
    arrays = [
        jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("a", "b"))),
        jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, P())),
    ]
    text = cloud_pathways_helper.get_bulk_write_request(
        "/ckpt/1.orbax-checkpoint-tmp", ["w", "step"], arrays, datetime.timedelta(seconds=90.5)
    )
    ((key, body),) = json.loads(text).items()
    w, step = requests.parse(key, body)
    assert (w.location, w.name, w.shape, w.timeout_s, w.dtype) == (
        "/ckpt/1.orbax-checkpoint-tmp",
        "w",
        (8, 8),
        90.5,
        None,
    )
    assert w.sharding.device_ids == (0, 1, 2, 3)
    assert w.sharding.shard_indices((8, 8)) == tuple(
        tuple(arrays[0].sharding.devices_indices_map((8, 8))[d]) for d in mesh.devices.flat
    )
    assert step.sharding.op_sharding is None  # replicated: every device holds it all
    assert step.sharding.shard_indices((8,)) == ((slice(None),),) * 4


def test_a_read_request_as_orbax_sends_it():
    mesh = _mesh()
    text = cloud_pathways_helper.get_bulk_read_request(
        "gs://bucket/run/7",
        ["params.w"],
        [np.dtype(ml_dtypes.bfloat16)],
        [(4, 6)],
        [NamedSharding(mesh, P(None, "b"))],
        mesh.devices,
        datetime.timedelta(hours=1),
    )
    ((key, body),) = json.loads(text).items()
    assert key == requests.READ_KEY
    (array,) = requests.parse(key, body)
    assert (array.location, array.name, array.shape, array.dtype) == (
        "gs://bucket/run/7",
        "params.w",
        (4, 6),
        "bfloat16",
    )
    assert array.nbytes == 48 and array.timeout_s == 3600
    assert array.sharding.shard_indices((4, 6))[1] == (slice(None), slice(3, 6))


def _entry(**changes) -> dict:
    entry = {
        "b64_location": base64.b64encode(b"/ckpt").decode(),
        "b64_name": base64.b64encode(b"x").decode(),
        "b64_hlo_sharding_string": "",
        "shape": [4],
        "devices": {"device_ids": [0, 1]},
        "timeout": {"seconds": 5, "nanos": 0},
    }
    entry.update(changes)
    return entry


def test_camel_case_string_integers_and_duration_strings_are_read():
    entry = {
        "b64Location": base64.b64encode(b"/ckpt").decode(),
        "b64Name": base64.b64encode(b"x").decode(),
        "b64HloShardingString": "",
        "shape": ["4"],
        "devices": {"deviceIds": ["0", "1"]},
        "timeout": "2.5s",
    }
    (array,) = requests.parse(requests.WRITE_KEY, {"writeRequests": [entry]})
    assert (array.shape, array.sharding.device_ids, array.timeout_s) == ((4,), (0, 1), 2.5)
    (array,) = requests.parse(
        requests.WRITE_KEY, {"write_requests": [_entry(timeout={"seconds": "7", "nanos": 500_000_000})]}
    )
    assert array.timeout_s == 7.5


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([], "must be a JSON object"),
        ({}, "has no 'write_requests'"),
        ({"write_requests": []}, "non-empty list"),
        ({"write_requests": ["x"]}, "must be a JSON object"),
        ({"write_requests": [_entry(b64_location="not base64!")]}, "not base64"),
        ({"write_requests": [_entry(b64_name="")]}, "non-empty location and name"),
        ({"write_requests": [_entry(shape=[-1])]}, "non-negative integers"),
        ({"write_requests": [_entry(shape="4")]}, "list of at most"),
        ({"write_requests": [_entry(shape=[1 << 40, 1 << 40])]}, "more elements than any array can"),
        ({"write_requests": [_entry(devices={"device_ids": []})]}, "device_ids must be a non-empty list"),
        ({"write_requests": [_entry(devices={"device_ids": [0, 0]})]}, "distinct"),
        ({"write_requests": [_entry(devices=[0, 1])]}, "device_ids must be a non-empty list"),
        ({"write_requests": [_entry(b64_hlo_sharding_string="CAMaAgICSgEEUgEA")]}, "sharding"),
        ({"write_requests": [_entry(b64_hlo_sharding_string=base64.b64encode(b"\xff\x01").decode())]}, "sharding"),
        ({"write_requests": [_entry(timeout="forever")]}, "duration"),
        ({"write_requests": [_entry(timeout={"seconds": 0})]}, "longer than zero"),
        ({"write_requests": [_entry(timeout={"seconds": 1, "nanos": -1})]}, "seconds and nanos"),
    ],
)
def test_malformed_write_requests_are_refused_clearly(body, says):
    with pytest.raises(InvalidRequest, match="Bad PluginProgram") as raised:
        requests.parse(requests.WRITE_KEY, body)
    assert says in raised.value.message


@pytest.mark.parametrize(
    ("shape", "says"),
    [
        ([4], "must be an object"),
        ({"dimensions": [4]}, "has no 'xla_primitive_type_str'"),
        ({"xla_primitive_type_str": "TOKEN", "dimensions": [4]}, "not a dtype a checkpoint holds"),
    ],
)
def test_malformed_read_requests_are_refused_clearly(shape, says):
    with pytest.raises(InvalidRequest, match="Bad PluginProgram") as raised:
        requests.parse(requests.READ_KEY, {"read_requests": [_entry(shape=shape)]})
    assert says in raised.value.message
