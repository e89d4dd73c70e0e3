"""Array shards between a worker and a colocated Python executor of its host.

Both ends see the executor's own directory: big shards travel as files there (the receiver
removes them), small ones and string arrays inside the message. The two ends do not trust each
other alike: the executor runs a tenant's code, so the worker never maps a file the executor
wrote (the executor could truncate it under the mapping and crash the worker with SIGBUS); it
reads it into memory of its own. The executor maps the worker's files, which it cannot change.
"""

from __future__ import annotations

import itertools
import mmap
import os
import stat
from pathlib import Path

import numpy as np

from pathways_nb.core import tuning
from pathways_nb.protocol import dtypes
from pathways_nb.protocol.errors import InvalidRequest
from pathways_nb.rpc import cluster_pb2 as pb

STRING_KIND = 99  # xla.ifrt.DTypeProto.Kind kString
_names = itertools.count()


def kind_of(dtype: np.dtype) -> int:
    """The IFRT dtype kind of a numpy dtype (strings included)."""
    if isinstance(dtype, np.dtypes.StringDType):
        return STRING_KIND
    return dtypes.from_numpy(dtype)


def dtype_of(kind: int) -> np.dtype:
    """The numpy dtype of an IFRT dtype kind (strings included)."""
    if kind == STRING_KIND:
        return np.dtypes.StringDType()
    return dtypes.to_numpy(kind)


def encode(device_id: int, host: np.ndarray, directory: Path | None, owner: int | None = None) -> pb.ColocatedShard:
    """One shard for the other end: its strings, its bytes, or (big, with a ``directory``) a file there.

    ``owner``: the uid the file is handed to (the executor's, when it runs as another user).
    """
    shard = pb.ColocatedShard(device_id=device_id, shape=host.shape)
    if isinstance(host.dtype, np.dtypes.StringDType):
        shard.strings.values.extend(str(value) for value in host.reshape(-1))
        return shard
    data = memoryview(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
    if directory is None or data.nbytes < tuning.SHARED_MEMORY_MIN_BYTES.value:
        shard.bytes = data.tobytes()
        return shard
    name = f"shard-{os.getpid()}-{next(_names)}"
    try:
        _write(directory / name, data, owner)
    except OSError:  # shared memory full, or a name the other side took: the bytes go in the message
        shard.bytes = data.tobytes()
        return shard
    shard.file = name
    return shard


def _write(path: Path, data: memoryview, owner: int | None) -> None:
    """A new file (never through a link, never over an existing one) with ``data``, handed to ``owner``."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        if owner is not None and owner != os.getuid():
            os.fchown(descriptor, owner, -1)
        with os.fdopen(descriptor, "wb", closefd=False) as file:
            file.write(data)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(descriptor)


def decode(
    shard: pb.ColocatedShard,
    kind: int,
    directory: Path | None,
    map_file: bool,
    expected_shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    """A shard's value, of dtype ``kind``; a file is removed once read.

    ``map_file``: map the file (its writer cannot change it: the executor's side) instead of
    reading it into memory of this process (the worker's side). ``expected_shape``: the shape the
    shard must have, checked before any memory is set aside for it (the worker's side: the
    executor says what it sends, and is not believed).
    """
    dtype = dtype_of(kind)
    shape = tuple(shard.shape)
    if expected_shape is not None and shape != tuple(expected_shape):
        raise InvalidRequest(f"a shard of shape {list(shape)} where {list(expected_shape)} was due")
    which = shard.WhichOneof("data")
    count = int(np.prod(shape, dtype=np.int64))
    if kind == STRING_KIND:
        if which != "strings" or len(shard.strings.values) != count:
            raise InvalidRequest(f"a string shard of shape {list(shape)} needs {count} strings")
        return np.array(list(shard.strings.values), dtype=dtype).reshape(shape)
    size = count * dtype.itemsize
    if which == "bytes":
        if len(shard.bytes) != size:
            raise InvalidRequest(f"{len(shard.bytes)} bytes for a {dtype}{list(shape)} shard, which needs {size}")
        return np.frombuffer(shard.bytes, dtype).reshape(shape)
    if which == "file" and directory is not None:
        return np.frombuffer(_take(directory, shard.file, size, map_file), dtype).reshape(shape)
    raise InvalidRequest(f"a {dtype}{list(shape)} shard came with no data")


def _take(directory: Path, name: str, size: int, map_file: bool):
    """The ``size`` bytes of file ``name`` in ``directory`` (a plain name there, a regular file); removed."""
    if not name or os.path.basename(name) != name or name in (".", ".."):
        raise InvalidRequest(f"{name!r} does not name a file of the executor's directory")
    path = directory / name
    try:
        # (O_NONBLOCK: a FIFO put there would otherwise block the open until someone writes to it.)
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        raise InvalidRequest(f"cannot open the shard file {name}: {error.strerror}") from None
    try:
        os.unlink(path)
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise InvalidRequest(f"the shard file {name} is not a regular file of {size} bytes")
        if size == 0:
            return b""
        if map_file:
            return mmap.mmap(descriptor, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        buffer = np.empty(size, np.uint8)  # (no zero fill: every byte is read over)
        view, done = memoryview(buffer), 0
        while done < size:
            read = os.readv(descriptor, [view[done:]])
            if read == 0:
                raise InvalidRequest(f"the shard file {name} ended after {done} of its {size} bytes")
            done += read
        return buffer
    finally:
        os.close(descriptor)
