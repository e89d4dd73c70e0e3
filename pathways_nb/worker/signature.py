"""Global argument and result types of a StableHLO program, read before it runs.

After SPMD partitioning XLA only knows per-device shapes, and an unevenly
sharded result is padded, so global shapes cannot be recovered from the
compiled executable. They are read from the program's ``main`` function.
"""

from __future__ import annotations

import re
import threading

import ml_dtypes
import numpy as np

from pathways_nb.compat import stablehlo as stablehlo_versions
from pathways_nb.core.runtime_api import Aval, Signature
from pathways_nb.protocol.errors import InvalidRequest

# MLIR element type -> numpy dtype.
_ELEMENT_TYPES: dict[str, np.dtype] = {
    "i1": np.dtype(np.bool_),
    "i2": np.dtype(ml_dtypes.int2),
    "i4": np.dtype(ml_dtypes.int4),
    "i8": np.dtype(np.int8),
    "i16": np.dtype(np.int16),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    "ui2": np.dtype(ml_dtypes.uint2),
    "ui4": np.dtype(ml_dtypes.uint4),
    "ui8": np.dtype(np.uint8),
    "ui16": np.dtype(np.uint16),
    "ui32": np.dtype(np.uint32),
    "ui64": np.dtype(np.uint64),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "complex<f32>": np.dtype(np.complex64),
    "complex<f64>": np.dtype(np.complex128),
    "f8E4M3FN": np.dtype(ml_dtypes.float8_e4m3fn),
    "f8E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "f8E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "f8E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "f8E4M3B11FNUZ": np.dtype(ml_dtypes.float8_e4m3b11fnuz),
    "f8E4M3": np.dtype(ml_dtypes.float8_e4m3),
    "f8E3M4": np.dtype(ml_dtypes.float8_e3m4),
    "f8E8M0FNU": np.dtype(ml_dtypes.float8_e8m0fnu),
    "f4E2M1FN": np.dtype(ml_dtypes.float4_e2m1fn),
}
_TENSOR = re.compile(r"tensor<((?:[0-9?]+x)*)(.+)>")
_MLIR_LOCK = threading.Lock()


def _aval(mlir_type) -> Aval:
    text = str(mlir_type)
    if text == "!stablehlo.token":
        return Aval((), None)
    match = _TENSOR.fullmatch(text)
    if not match:
        raise InvalidRequest(f"the program's main function uses type {text}, which this server cannot hold")
    dims, element = match.groups()
    if "?" in dims:
        raise InvalidRequest(f"the program's main function has a dynamic shape ({text}); use static shapes")
    try:
        dtype = _ELEMENT_TYPES[element]
    except KeyError:
        raise InvalidRequest(f"the program's main function uses element type {element}") from None
    return Aval(tuple(int(d) for d in dims.split("x")[:-1]), dtype)


def read(program: bytes) -> Signature:
    """The global types of ``main``'s arguments and results in a StableHLO artifact."""
    from jax._src.interpreters import mlir
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo

    with _MLIR_LOCK, mlir.make_ir_context() as context:
        try:
            module = stablehlo.deserialize_portable_artifact(context, program)
        except Exception as e:
            raise InvalidRequest(stablehlo_versions.unreadable(program, e)) from e
        for operation in module.body.operations:
            if (
                operation.operation.name == "func.func"
                and ir.StringAttr(operation.attributes["sym_name"]).value == "main"
            ):
                function_type = ir.FunctionType(ir.TypeAttr(operation.attributes["function_type"]).value)
                return Signature(
                    tuple(_aval(t) for t in function_type.inputs),
                    tuple(_aval(t) for t in function_type.results),
                )
    raise InvalidRequest("the program has no main function")
