"""The IFRT proxy wire schema, read from the installed jaxlib.

jaxlib compiles the serialized ``FileDescriptorProto`` of every XLA ``.proto``
file into its shared library. Reading them from there (instead of shipping
copies of XLA's ``.proto`` files) gives message classes that match the
installed client field for field. The scan of the ~350 MB library takes a
fraction of a second and happens once per process.
"""

from __future__ import annotations

import functools
import mmap
import os
import re
from collections.abc import Iterator
from types import SimpleNamespace

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from pathways_nb.errors import SchemaUnavailableError

# The files whose messages the proxy, the workers and the tests use; their
# imports are loaded with them.
ROOT_FILES = (
    "xla/python/ifrt_proxy/common/grpc_ifrt_service.proto",
    "xla/python/ifrt_proxy/common/ifrt_service.proto",
    "xla/python/ifrt/sharding_serdes.proto",
    "xla/python/pjrt_ifrt/xla_sharding.proto",
    "xla/python/pjrt_ifrt/xla_compiler.proto",
    "xla/python/ifrt/execute_options.proto",
    "xla/pjrt/proto/compile_options.proto",
    "xla/service/hlo.proto",
    "xla/python/pjrt_ifrt/pjrt_layout_serdes.proto",
    "xla/python/ifrt/custom_call_program.proto",
)

# A serialized FileDescriptorProto starts with field 1 (the file name):
# tag 0x0a, a one-byte length, then the name.
_FILE_NAME = re.compile(rb"\x0a([\x05-\x7f])((?:xla|tsl|google)/[A-Za-z0-9_/.\-]*\.proto)")

# FileDescriptorProto field number -> wire type, used to find where one
# embedded descriptor ends (the bytes after it are unrelated data).
_FILE_FIELD_WIRE_TYPES = {
    1: 2,
    2: 2,
    3: 2,
    4: 2,
    5: 2,
    6: 2,
    7: 2,
    8: 2,
    9: 2,
    10: 0,
    11: 0,
    12: 2,
    14: 0,
    15: 2,
}


def _read_varint(buf: mmap.mmap, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _descriptor_end(buf: mmap.mmap, pos: int) -> int:
    """Walks top-level fields from ``pos`` until one cannot belong to a FileDescriptorProto."""
    while pos < len(buf):
        tag, after_tag = _read_varint(buf, pos)
        if _FILE_FIELD_WIRE_TYPES.get(tag >> 3) != tag & 7:
            return pos
        if tag & 7 == 2:
            length, after_len = _read_varint(buf, after_tag)
            pos = after_len + length
        else:
            _, pos = _read_varint(buf, after_tag)
    return pos


def _embedded_descriptors(path: str) -> Iterator[descriptor_pb2.FileDescriptorProto]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for match in _FILE_NAME.finditer(buf):
            if match.group(1)[0] != len(match.group(2)):
                continue
            start = match.start()
            proto = descriptor_pb2.FileDescriptorProto()
            try:
                proto.ParseFromString(buf[start : _descriptor_end(buf, start)])
            except Exception:  # noqa: BLE001 - a byte pattern that only looked like a descriptor
                continue
            if proto.name == match.group(2).decode():
                yield proto


def jaxlib_library_path() -> str:
    """The jaxlib shared library that carries the XLA descriptors.

    ``libjax_common.so`` in jaxlib 0.10.2 to 0.12; should a jaxlib name it
    otherwise, the largest of its shared libraries (the one XLA is linked into).
    """
    import jaxlib

    directory = os.path.dirname(jaxlib.__file__)
    common = os.path.join(directory, "libjax_common.so")
    if os.path.exists(common):
        return common
    libraries = [os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".so")]
    return max(libraries, key=os.path.getsize, default=common)


def _jaxlib_version() -> str:
    try:
        import jaxlib.version

        return jaxlib.version.__version__
    except ImportError:
        return "not installed"


# Short names for the packages the project reads messages from.
PACKAGES = {
    "proxy": "xla.ifrt.proxy",
    "ifrt": "xla.ifrt",
    "ifrt_proto": "xla.ifrt.proto",
    "xla": "xla",
    "tensorflow": "tensorflow",
}


@functools.cache
def load() -> SimpleNamespace:
    """Message classes of the IFRT proxy protocol, grouped by proto package (read once per process).

    ``load().proxy.IfrtRequest`` is ``xla.ifrt.proxy.IfrtRequest``,
    ``load().ifrt.ShardingProto`` is ``xla.ifrt.ShardingProto``, and so on for
    the packages in ``PACKAGES``; nested messages are attributes of their
    parent class (``load().proxy.InitResponse.Device``). Every caller gets the same classes:
    a message of one read cannot be copied into a message of another.
    """
    return read(jaxlib_library_path())


def read(path: str) -> SimpleNamespace:
    """The message classes of the descriptors in the shared library at ``path`` (a fresh pool each call)."""
    try:
        found = {proto.name: proto for proto in _embedded_descriptors(path)}
    except OSError as e:
        raise SchemaUnavailableError(_jaxlib_version(), f"cannot read {path}: {e}") from e
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(name: str) -> None:
        if name in added:
            return
        if name not in found:
            raise SchemaUnavailableError(_jaxlib_version(), f"{path} holds no descriptor for {name}")
        for dependency in found[name].dependency:
            add(dependency)
        pool.Add(found[name])
        added.add(name)

    for root in ROOT_FILES:
        add(root)

    by_package: dict[str, dict[str, type]] = {package: {} for package in PACKAGES.values()}
    for name in added:
        file_descriptor = pool.FindFileByName(name)
        if file_descriptor.package in by_package:
            for short, descriptor in file_descriptor.message_types_by_name.items():
                by_package[file_descriptor.package][short] = message_factory.GetMessageClass(descriptor)
    namespaces = {alias: SimpleNamespace(**by_package[package]) for alias, package in PACKAGES.items()}
    return SimpleNamespace(pool=pool, **namespaces)
