"""What jax's colocated Python ships, run on this executor's CPU devices.

The program text is ``cloudpickle`` of ``(fun, in_treedef, in_specs, out_treedef, out_specs,
devices)`` (jax ``colocated_python/func.py``), whose shardings name devices by the cluster's ids:
``jax.experimental.colocated_python.serialization`` resolves them through its CPU device map,
which this module points at this executor's own devices (``ColocatedDevices.install``). Loaded
programs stay for the executor's life: ``colocated_python_class`` keeps its objects through them.
"""

from __future__ import annotations

import hashlib
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pathways_nb.protocol.errors import FailedPrecondition, InvalidRequest, RequestError


class UserError(RequestError):
    """The user's function raised (its message and the remote traceback), or returned what it may not.

    UNKNOWN, not INTERNAL: pathwaysutils' elastic mode reads INTERNAL as a slice that went down.
    """

    code = 2  # UNKNOWN


def versions() -> dict[str, str]:
    """This executor's Python (major.minor), jax and cloudpickle versions."""
    import cloudpickle
    import jax

    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "jax": jax.__version__,
        "cloudpickle": cloudpickle.__version__,
    }


def check_client_versions(client: dict[str, str]) -> None:
    """Refuses a client whose versions differ from this executor's (where it sent them): pickles do not travel."""
    own = versions()
    given = {name: value for name, value in client.items() if value}
    if "python" in given:
        given["python"] = ".".join(given["python"].split(".")[:2])
    differ = {name for name, value in given.items() if own[name] != value}
    if differ:
        raise FailedPrecondition(
            "colocated Python unpickles your function on the cluster, which runs "
            + _describe(own)
            + "; your client runs "
            + _describe({**own, **given})
            + ". Use the same versions on both sides (cloudpickle's pickles are not portable across them)"
        )


def _describe(found: dict[str, str]) -> str:
    return f"Python {found['python']}, jax {found['jax']}, cloudpickle {found['cloudpickle']}"


class ColocatedDevices:
    """This executor's CPU devices, one per colocated CPU device of its host, by cluster id."""

    def __init__(self, cluster_ids: Sequence[int]):
        import jax

        local = sorted(jax.devices("cpu"), key=lambda d: d.id)
        if len(local) != len(cluster_ids):
            raise RuntimeError(f"{len(local)} CPU devices for the colocated devices {list(cluster_ids)}")
        self.by_cluster_id = dict(zip(cluster_ids, local, strict=True))
        self._cluster_ids = {device.id: cluster_id for cluster_id, device in self.by_cluster_id.items()}

    def cluster_id(self, device) -> int:
        return self._cluster_ids[device.id]

    def install(self) -> None:
        """Makes jax's colocated serialization speak the cluster's device ids, both ways.

        Pickled shardings name devices by id; the controller's ids are the cluster's, not this
        process's. Unpickling resolves them through jax's CPU device map, and pickling (the output
        specs a first call returns) reads ``device.id``: both are replaced here. jax looks these
        functions up by name at each use, so replacing them in its module is enough (Orbax's
        Pathways patch does the same).
        """
        import numpy
        from jax.experimental.colocated_python import serialization

        by_cluster_id, cluster_id = self.by_cluster_id, self.cluster_id

        @serialization._make_reduce_func_with_common_obj
        def reduce_mesh(mesh):
            ids = numpy.vectorize(cluster_id, otypes=[int])(mesh.devices)
            return serialization._unreduce_mesh, (ids, mesh.axis_names, mesh.axis_types)

        @serialization._make_reduce_func_with_common_obj
        def reduce_device_list(device_list):
            return serialization._unreduce_device_list, ([cluster_id(d) for d in device_list],)

        @serialization._make_reduce_func_with_common_obj
        def reduce_single_device_sharding(sharding):
            device = next(iter(sharding.device_set))
            return serialization._unreduce_single_device_sharding, (cluster_id(device), sharding.memory_kind)

        serialization._get_cpu_device_map = lambda: by_cluster_id
        serialization._reduce_mesh = reduce_mesh
        serialization._reduce_device_list = reduce_device_list
        serialization._reduce_single_device_sharding = reduce_single_device_sharding


@dataclass(frozen=True)
class Program:
    """One function with its specialization, as jax pickled it."""

    name: str
    fun: Any
    in_treedef: Any
    in_specs: tuple
    out_treedef: Any
    out_specs: tuple


class Programs:
    """The programs this executor has loaded, by the sha256 of their text."""

    def __init__(self) -> None:
        self._loaded: dict[bytes, Program] = {}

    def get(self, digest: bytes, text: bytes, name: str) -> Program:
        program = self._loaded.get(digest)
        if program is not None:
            return program
        if not text:
            raise FailedPrecondition(f"program {name} is not loaded on this executor; send its text")
        if hashlib.sha256(text).digest() != digest:
            raise InvalidRequest(f"the text of program {name} does not match its digest")
        program = self._loaded[digest] = _load(text, name)
        return program


def _load(text: bytes, name: str) -> Program:
    from jax.experimental.colocated_python import serialization

    try:
        fun, in_treedef, in_specs, out_treedef, out_specs, _devices = serialization._deserialize(text)
    except Exception as error:  # noqa: BLE001 - whatever unpickling raises, the answer says what to do
        raise FailedPrecondition(
            f"the function {name} could not be unpickled here ({type(error).__name__}: {error}). The cluster runs "
            f"{_describe(versions())}: a client of other versions, or a function that needs a module this "
            "executor cannot import, cannot run here"
        ) from None
    return Program(name, fun, in_treedef, tuple(in_specs), out_treedef, tuple(out_specs))


def make_args(program: Program, leaves: Sequence) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for the function from one array per input spec."""
    from jax import tree_util

    if len(leaves) != len(program.in_specs):
        raise InvalidRequest(f"{program.name} takes {len(program.in_specs)} arrays, got {len(leaves)}")
    return tree_util.tree_unflatten(program.in_treedef, list(leaves))


def call(program: Program, args: tuple, kwargs: dict) -> list:
    """Runs the function; its outputs, checked against (and laid out by) its output specs."""
    import jax
    from jax import tree_util

    try:
        result = program.fun(*args, **kwargs)
        leaves = tree_util.tree_leaves(result)
        jax.block_until_ready(leaves)
    except Exception as error:  # noqa: BLE001 - the user's code: its error goes back to the client
        raise UserError(
            f"{type(error).__name__}: {error}\n\nRemote traceback (colocated Python executor):\n"
            + "".join(traceback.format_exception(error))
        ) from None
    if len(leaves) != len(program.out_specs):
        raise UserError(f"{program.name} returned {len(leaves)} arrays, its output specs say {len(program.out_specs)}")
    return [
        _as_specified(program.name, index, leaf, spec)
        for index, (leaf, spec) in enumerate(zip(leaves, program.out_specs, strict=True))
    ]


def _as_specified(name: str, index: int, leaf, spec):
    import jax

    if not isinstance(leaf, jax.Array):
        raise UserError(
            f"output {index} of {name} is a {type(leaf).__name__}: colocated_python only supports jax.Array "
            "as input and output (jax.device_put it onto the input's devices)"
        )
    if tuple(leaf.shape) != tuple(spec.shape) or np.dtype(leaf.dtype) != np.dtype(spec.dtype):
        raise UserError(
            f"output {index} of {name} is {leaf.dtype}{list(leaf.shape)}, its output spec says "
            f"{spec.dtype}{list(spec.shape)}"
        )
    if spec.sharding is not None and not leaf.sharding.is_equivalent_to(spec.sharding, leaf.ndim):
        leaf = jax.device_put(leaf, spec.sharding)
    return leaf
