"""Arrays of byte strings (IFRT ``kString``), as plugin and custom-call programs return them.

XLA holds no strings, so a string array is a host value: ``StringArray`` answers what the servers
ask of a device value (``delete``, ``is_deleted``, ``block_until_ready``). On the wire, to the stock
client and between a worker and the proxy, its contents are IFRT's ``StringArrayContents``
message (field 1, ``repeated bytes strings``), one string per element in row-major order: the
client refuses a buffer whose count differs from the array's element count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from pathways_nb.protocol.errors import InvalidRequest


class StringArray:
    """A host array of byte strings, held where its program ran."""

    __slots__ = ("_deleted", "shape", "strings")

    def __init__(self, shape: tuple[int, ...], strings: Iterable[bytes | str]):
        self.shape = tuple(shape)
        self.strings = [s.encode() if isinstance(s, str) else bytes(s) for s in strings]
        if len(self.strings) != math.prod(self.shape):
            raise InvalidRequest(f"{len(self.strings)} strings for a string array of shape {list(self.shape)}")
        self._deleted = False

    @property
    def nbytes(self) -> int:
        return sum(len(s) for s in self.strings)

    def delete(self) -> None:
        self._deleted = True
        self.strings = []

    def is_deleted(self) -> bool:
        return self._deleted

    def block_until_ready(self) -> StringArray:
        return self

    def is_ready(self) -> bool:
        return True

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        host = np.empty(len(self.strings), dtype=object)
        host[:] = self.strings
        return host.reshape(self.shape)

    def to_wire(self) -> bytes:
        """The contents as the stock client reads them (``StringArrayContents``)."""
        return encode(self.strings)


def encode(strings: Iterable[bytes]) -> bytes:
    """``StringArrayContents{strings}`` serialized: each string as field 1, length-delimited."""
    parts = []
    for data in strings:
        parts.append(b"\x0a" + _varint(len(data)) + data)
    return b"".join(parts)


def decode(data: bytes | memoryview, shape: tuple[int, ...]) -> StringArray:
    """A ``StringArray`` of ``shape`` from ``encode``'s bytes; a clear error for anything else."""
    view = memoryview(data).cast("B")
    strings, position = [], 0
    while position < len(view):
        if view[position] != 0x0A:
            raise InvalidRequest(f"malformed string array contents: byte {position} is not field 1")
        length, position = _read_varint(view, position + 1)
        if position + length > len(view):
            raise InvalidRequest("malformed string array contents: a string runs past the end")
        strings.append(bytes(view[position : position + length]))
        position += length
    return StringArray(shape, strings)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(view: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while position < len(view) and shift < 64:
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
    raise InvalidRequest("malformed string array contents: a length runs past the end")
