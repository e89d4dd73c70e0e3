"""Orbax's persistence requests (``bulk_persistence_write_request`` / ``..._read_request``) as plain values.

Orbax's ``CloudPathwaysArrayHandler`` (``cloud_pathways_helper``) sends checkpoint writes and
reads as plugin programs whose JSON names, per array, the parent directory and the parameter
name (base64), the array's global shape, its sharding (a base64 serialized ``xla.OpSharding``),
its devices and a timeout::

    {"bulk_persistence_write_request": {"write_requests": [
        {"b64_location": ..., "b64_name": ..., "b64_hlo_sharding_string": ..., "shape": [8, 4],
         "devices": {"device_ids": [0, 1]}, "timeout": {"seconds": 3600, "nanos": 0}}]}}
    {"bulk_persistence_read_request": {"read_requests": [
        {"b64_location": ..., "b64_name": ..., "b64_hlo_sharding_string": ...,
         "shape": {"xla_primitive_type_str": "BF16", "dimensions": [8, 4]},
         "devices": {"device_ids": [0, 1]}, "timeout": ...}]}}

A write's dtype is its argument's; a read's comes from ``xla_primitive_type_str``. Field names
are accepted in snake_case and in protobuf JSON's camelCase, and the timeout as an object or as a
protobuf JSON duration (``"3600s"``), since the request is protobuf JSON on Pathways' side. Both
sides parse with this module: the proxy to check a request before anything runs, each worker to
do its part; the proxy sends every host the request and which of its devices each host holds
(``HostRequest``).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from pathways_nb.core import tuning
from pathways_nb.core.nonxla import HostContext
from pathways_nb.protocol.errors import Internal, InvalidRequest
from pathways_nb.protocol.op_sharding import plain as plain_op_sharding
from pathways_nb.protocol.op_sharding import read as read_op_sharding
from pathways_nb.protocol.shardings import IfrtSharding

WRITE_KEY = "bulk_persistence_write_request"
READ_KEY = "bulk_persistence_read_request"

# Arrays per request and dimensions per array a server takes: far above any model's, far below harm.
MAX_ARRAYS = 1 << 16
MAX_RANK = 64
MAX_PATH_BYTES = 4096
# Elements of one array: what 64-bit sizes on the wire can count.
MAX_ELEMENTS = 1 << 62

# XLA primitive type names (``xla_primitive_type_str``) of the dtypes a checkpoint can hold.
_PRIMITIVE_TYPES: dict[str, np.dtype] = {
    "PRED": np.dtype(np.bool_),
    "S8": np.dtype(np.int8),
    "S16": np.dtype(np.int16),
    "S32": np.dtype(np.int32),
    "S64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
    "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32),
    "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "C128": np.dtype(np.complex128),
}


@dataclass(frozen=True)
class ArrayRequest:
    """One array of a bulk request: where it is stored, its global shape and how it is laid out."""

    location: str  # the checkpoint's directory as the client named it (a local path or gs://...)
    name: str  # the parameter's name: the array lives in <location>/<name>
    shape: tuple[int, ...]
    sharding: IfrtSharding  # over the request's devices, in the client's device ids
    timeout_s: float
    dtype: np.dtype | None = None  # reads only: writes take their argument's

    @property
    def what(self) -> str:
        """The array as error messages name it."""
        return f"array {self.name!r} in {self.location}"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (self.dtype.itemsize if self.dtype is not None else 0)

    @property
    def place(self) -> str:
        """Where the array's files go: its own directory in the checkpoint's (``<location>/<name>``)."""
        return self.location.rstrip("/") + "/" + self.name


@dataclass(frozen=True)
class HostRequest:
    """What every host of one execution gets: the client's request, and whose devices are whose."""

    arrays: list[ArrayRequest]
    # (island, host index) -> that host's devices among the plan's, in the plan's order (the
    # order in which the host is given its local ids).
    hosts: dict[tuple[int, int], list[int]]

    def encode(self, key: str, body: Any) -> bytes:
        hosts = [[island, host, ids] for (island, host), ids in self.hosts.items()]
        return json.dumps({"key": key, "body": body, "hosts": hosts}).encode()

    @classmethod
    def decode(cls, data: bytes) -> HostRequest:
        message = json.loads(data)
        hosts = {(island, host): ids for island, host, ids in message["hosts"]}
        return cls(parse(message["key"], message["body"]), hosts)

    def global_ids(self, context: HostContext, local_ids: Sequence[int]) -> dict[int, int]:
        """This host's local device ids -> the session's ids for them."""
        mine = self.hosts.get((context.island, context.host_index), [])
        if len(mine) != len(local_ids):
            raise Internal(
                f"island {context.island} host {context.host_index} was given devices {list(local_ids)}, "
                f"but the plan gives it {mine}"
            )
        return dict(zip(local_ids, mine, strict=True))


def parse(key: str, body: object) -> list[ArrayRequest]:
    """The arrays of a write (``WRITE_KEY``) or read (``READ_KEY``) request's body; a clear error if malformed."""
    reading = key == READ_KEY
    list_name = "read_requests" if reading else "write_requests"
    if not isinstance(body, dict):
        raise InvalidRequest(f"Bad PluginProgram: {key} must be a JSON object with {list_name!r}")
    entries = _field(body, list_name, key)
    if not isinstance(entries, list) or not entries:
        raise InvalidRequest(f"Bad PluginProgram: {key}.{list_name} must be a non-empty list of arrays")
    if len(entries) > MAX_ARRAYS:
        raise InvalidRequest(f"Bad PluginProgram: {len(entries)} arrays in one {key}; at most {MAX_ARRAYS}")
    return [_array(entry, f"{key}.{list_name}[{i}]", reading) for i, entry in enumerate(entries)]


def _array(entry: object, where: str, reading: bool) -> ArrayRequest:
    if not isinstance(entry, dict):
        raise InvalidRequest(f"Bad PluginProgram: {where} must be a JSON object")
    location = _b64_text(_field(entry, "b64_location", where), f"{where}.b64_location")
    name = _b64_text(_field(entry, "b64_name", where), f"{where}.b64_name")
    if not location or not name:
        raise InvalidRequest(f"Bad PluginProgram: {where} needs a non-empty location and name")
    shape_field = _field(entry, "shape", where)
    dtype = None
    if reading:
        if not isinstance(shape_field, dict):
            raise InvalidRequest(
                f"Bad PluginProgram: {where}.shape must be an object with xla_primitive_type_str and dimensions"
            )
        dtype = _dtype(_field(shape_field, "xla_primitive_type_str", f"{where}.shape"), f"{where}.shape")
        shape_field = _field(shape_field, "dimensions", f"{where}.shape", default=[])
    shape = _dimensions(shape_field, f"{where}.shape")
    devices = _field(entry, "devices", where)
    device_ids = _device_ids(_field(devices, "device_ids", f"{where}.devices") if isinstance(devices, dict) else None)
    if device_ids is None:
        raise InvalidRequest(f"Bad PluginProgram: {where}.devices.device_ids must be a non-empty list of device ids")
    sharding = _sharding(_field(entry, "b64_hlo_sharding_string", where), device_ids, shape, where)
    timeout_s = _timeout(_field(entry, "timeout", where, default=None), f"{where}.timeout")
    return ArrayRequest(location, name, shape, sharding, timeout_s, dtype)


def _field(obj: dict, name: str, where: str, default: object = ...) -> object:
    """``obj[name]`` under its snake_case or camelCase name."""
    camel = re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), name)
    for key in (name, camel):
        if key in obj:
            return obj[key]
    if default is ...:
        raise InvalidRequest(f"Bad PluginProgram: {where} has no {name!r}")
    return default


def _b64_text(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > 2 * MAX_PATH_BYTES:
        raise InvalidRequest(f"Bad PluginProgram: {where} must be a base64 string")
    try:
        text = base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise InvalidRequest(f"Bad PluginProgram: {where} is not base64 of UTF-8 text") from None
    if "\0" in text:
        raise InvalidRequest(f"Bad PluginProgram: {where} holds a NUL character")
    return text


def _dimensions(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_RANK:
        raise InvalidRequest(f"Bad PluginProgram: {where} must be a list of at most {MAX_RANK} dimensions")
    dims = tuple(_integer(v) for v in value)
    if any(d is None or d < 0 for d in dims):
        raise InvalidRequest(f"Bad PluginProgram: {where} must hold non-negative integers, not {value}")
    if math.prod(dims) > MAX_ELEMENTS or any(d > MAX_ELEMENTS for d in dims):
        raise InvalidRequest(f"Bad PluginProgram: {where} {list(dims)} has more elements than any array can")
    return dims


def _integer(value: object) -> int | None:
    """A JSON integer, also as protobuf JSON writes 64-bit ones (a string of digits)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,19}", value):
        return int(value)
    return None


def _device_ids(value: object) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not value:
        return None
    ids = tuple(_integer(v) for v in value)
    if any(i is None or i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise InvalidRequest(f"Bad PluginProgram: device ids must be distinct non-negative integers, not {value}")
    return ids


def _dtype(value: object, where: str) -> np.dtype:
    try:
        return _PRIMITIVE_TYPES[value]
    except (KeyError, TypeError):
        known = ", ".join(_PRIMITIVE_TYPES)
        raise InvalidRequest(
            f"Bad PluginProgram: {where}.xla_primitive_type_str {value!r} is not a dtype a checkpoint holds ({known})"
        ) from None


def _sharding(value: object, device_ids: tuple[int, ...], shape: tuple[int, ...], where: str) -> IfrtSharding:
    """The array's layout over ``device_ids``, read and checked in pure Python (never by XLA)."""
    if not isinstance(value, str):
        raise InvalidRequest(f"Bad PluginProgram: {where}.b64_hlo_sharding_string must be a base64 string")
    try:
        serialized = plain_op_sharding(base64.b64decode(value, validate=True), len(device_ids))
        tiling = read_op_sharding(serialized, len(device_ids))
        tiling.check_shape(shape)
    except binascii.Error:
        raise InvalidRequest(f"Bad PluginProgram: {where}.b64_hlo_sharding_string is not base64") from None
    except InvalidRequest as error:
        raise InvalidRequest(f"Bad PluginProgram: {where}'s sharding: {error.message}") from None
    return IfrtSharding(device_ids, None, None if tiling.is_fully_replicated else serialized)


def _timeout(value: object, where: str) -> float:
    """Seconds, from ``{"seconds", "nanos"}`` or a protobuf JSON duration such as ``"3600s"``."""
    if value is None:
        return tuning.PERSISTENCE_TIMEOUT_S.value
    if isinstance(value, str):
        match = re.fullmatch(r"(\d{1,12}(?:\.\d{1,9})?)s", value)
        if match is None:
            raise InvalidRequest(f"Bad PluginProgram: {where} {value!r} is not a duration such as '3600s'")
        seconds = float(match.group(1))
    elif isinstance(value, dict):
        whole = _integer(_field(value, "seconds", where, default=0))
        nanos = _integer(_field(value, "nanos", where, default=0))
        if whole is None or nanos is None or whole < 0 or not 0 <= nanos < 1_000_000_000:
            raise InvalidRequest(f"Bad PluginProgram: {where} must hold non-negative seconds and nanos, not {value}")
        seconds = whole + nanos / 1e9
    else:
        raise InvalidRequest(f"Bad PluginProgram: {where} must be {{'seconds', 'nanos'}} or a duration such as '3600s'")
    if seconds <= 0:
        raise InvalidRequest(f"Bad PluginProgram: {where} must be longer than zero")
    return seconds
