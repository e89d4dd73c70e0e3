"""The host-buffer messages (one ``bytes data = 1`` field) without protobuf's extra copies.

Uploads and downloads move gigabytes through ``GrpcHostBufferStoreRequest``
and ``GrpcHostBufferLookupResponse``. Parsing such a message with protobuf
copies its payload, and building one copies it again; here the payload is a
view into the received bytes, and a reply is its header plus one copy.
"""

from __future__ import annotations

from pathways_nb.protocol import schema

_DATA_TAG = 0x0A  # field 1, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode(chunk) -> bytes:
    """A message whose ``data`` is ``chunk`` (any buffer)."""
    view = memoryview(chunk)
    if not view.nbytes:
        return b""
    return b"".join((bytes((_DATA_TAG,)), _varint(view.nbytes), view))


def decode(raw: bytes) -> memoryview:
    """The ``data`` of a received message, as a view into ``raw``."""
    view = memoryview(raw)
    if not view.nbytes:
        return view
    if view[0] == _DATA_TAG:
        length, shift, position = 0, 0, 1
        while position < view.nbytes:
            byte = view[position]
            position += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                if position + length == view.nbytes:
                    return view[position:]
                break
    # Other fields present (or not a plain data message): let protobuf decide.
    return memoryview(schema.load().proxy.GrpcHostBufferStoreRequest.FromString(raw).data)
