"""The wire schema comes from the installed jaxlib; versions and values convert as the client expects."""

from __future__ import annotations

import numpy as np
import pytest

from pathways_nb.errors import SchemaUnavailableError
from pathways_nb.protocol import attributes, dtypes, schema, shardings
from pathways_nb.protocol.errors import InvalidRequest, Unimplemented
from pathways_nb.proxy import versions


def test_schema_has_the_service_messages():
    messages = schema.load()
    request = messages.proxy.IfrtRequest()
    assert "loaded_executable_execute_request" in request.DESCRIPTOR.fields_by_name
    assert messages.ifrt.ShardingProto.DESCRIPTOR.full_name == "xla.ifrt.ShardingProto"
    assert messages.xla.OpSharding.DESCRIPTOR.full_name == "xla.OpSharding"


def test_missing_library_names_the_jaxlib_version(tmp_path):
    # (schema.read, not the cached load: the rest of the process keeps the classes it already has)
    with pytest.raises(SchemaUnavailableError, match=r"jaxlib 0\.10\.2 to 0\.12\.0\.1.*'jaxlib>=0\.10\.2,<0\.13'"):
        schema.read(str(tmp_path / "libjax_common.so"))


def test_library_without_descriptors_is_refused(tmp_path):
    empty = tmp_path / "libjax_common.so"
    empty.write_bytes(b"\x00" * 1024)
    with pytest.raises(SchemaUnavailableError, match="holds no descriptor"):
        schema.read(str(empty))


@pytest.mark.parametrize(
    ("client", "chosen"),
    [((16, 25), 25), ((16, 22), 22), ((15, 16), 16), ((10, 40), 25)],
)
def test_version_choice(client, chosen):
    assert versions.choose(*client, 0, 3).protocol_version == chosen


@pytest.mark.parametrize("client", [(3, 9), (26, 30)])
def test_version_mismatch_says_what_to_install(client):
    with pytest.raises(versions.VersionMismatch, match=r"0\.7\.2 to 0\.12\.0\.1"):
        versions.choose(*client, 0, 3)


def test_dtype_kinds_round_trip():
    for dtype in [np.float32, np.int8, np.bool_, np.complex64, np.uint16]:
        assert dtypes.to_numpy(dtypes.from_numpy(np.dtype(dtype))) == np.dtype(dtype)
    with pytest.raises(InvalidRequest, match="token"):
        dtypes.to_numpy(dtypes.TOKEN_KIND)


def test_attributes_round_trip():
    values = {"slice_index": 1, "host": "worker-0", "coords": [0, 1, 2], "fast": True, "gbps": 1.5}
    assert attributes.to_dict(attributes.to_proto(values)) == values


def test_shardings_round_trip_and_refuse_what_they_cannot_hold():
    single = shardings.IfrtSharding((3,), "device")
    assert shardings.from_proto(single.to_proto()) == single
    replicated = shardings.IfrtSharding((0, 1, 2))
    assert shardings.from_proto(replicated.to_proto()) == replicated
    proto = single.to_proto()
    proto.serialized_sharding.type_name = "xla::ifrt::ShardingParamSharding"
    with pytest.raises(Unimplemented, match="ShardingParamSharding"):
        shardings.from_proto(proto)
    proto.serialized_sharding.type_name = shardings.HLO
    proto.serialized_sharding.data = b"\xff\xff\xff"
    with pytest.raises(InvalidRequest, match="malformed"):
        shardings.from_proto(proto)


def test_data_messages_match_protobuf():
    from pathways_nb.protocol import data_messages

    messages = schema.load()
    for payload in [b"", b"x", bytes(range(256)) * 300]:
        encoded = data_messages.encode(payload)
        assert messages.proxy.GrpcHostBufferLookupResponse.FromString(encoded).data == payload
        standard = messages.proxy.GrpcHostBufferStoreRequest(data=payload).SerializeToString()
        assert bytes(data_messages.decode(standard)) == payload
