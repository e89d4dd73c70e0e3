"""IFRT ``DTypeProto`` kinds and the numpy dtypes they hold on the host."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from pathways_nb.protocol.errors import InvalidRequest

# DTypeProto.Kind number -> numpy dtype of one host element. Numbers are the
# enum values of xla/python/ifrt/dtype.proto.
_KIND_TO_NUMPY: dict[int, np.dtype] = {
    1: np.dtype(np.bool_),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.uint8),
    7: np.dtype(np.uint16),
    8: np.dtype(np.uint32),
    9: np.dtype(np.uint64),
    10: np.dtype(np.float16),
    11: np.dtype(np.float32),
    12: np.dtype(np.float64),
    15: np.dtype(np.complex64),
    16: np.dtype(ml_dtypes.bfloat16),
    18: np.dtype(np.complex128),
    19: np.dtype(ml_dtypes.float8_e5m2),
    20: np.dtype(ml_dtypes.float8_e4m3fn),
    21: np.dtype(ml_dtypes.int4),
    22: np.dtype(ml_dtypes.uint4),
    23: np.dtype(ml_dtypes.float8_e4m3b11fnuz),
    24: np.dtype(ml_dtypes.float8_e5m2fnuz),
    25: np.dtype(ml_dtypes.float8_e4m3fnuz),
    26: np.dtype(ml_dtypes.int2),
    27: np.dtype(ml_dtypes.uint2),
    28: np.dtype(ml_dtypes.float8_e4m3),
    29: np.dtype(ml_dtypes.float8_e3m4),
    30: np.dtype(ml_dtypes.float4_e2m1fn),
    31: np.dtype(ml_dtypes.float8_e8m0fnu),
    32: np.dtype(ml_dtypes.int1),
    33: np.dtype(ml_dtypes.uint1),
}
_NUMPY_TO_KIND = {dtype: kind for kind, dtype in _KIND_TO_NUMPY.items()}

TOKEN_KIND = 17
# Arrays of byte strings (plugin and custom-call programs' results); no fixed-size host form.
STRING_KIND = 99
_KIND_NAMES = {0: "unspecified", 14: "opaque", TOKEN_KIND: "token", STRING_KIND: "string"}


def to_numpy(kind: int) -> np.dtype:
    """The host dtype of an IFRT dtype kind; a clear error for kinds with no host form."""
    try:
        return _KIND_TO_NUMPY[kind]
    except KeyError:
        name = _KIND_NAMES.get(kind, f"unknown kind {kind}")
        raise InvalidRequest(
            f"dtype {name} has no host representation on this server; send arrays of a numeric or boolean dtype"
        ) from None


def from_numpy(dtype: np.dtype) -> int:
    """The IFRT dtype kind of a numpy dtype."""
    try:
        return _NUMPY_TO_KIND[np.dtype(dtype)]
    except KeyError:
        raise InvalidRequest(f"dtype {dtype} has no IFRT equivalent") from None
