"""``xla.ifrt.AttributeMapProto`` to and from plain Python dicts.

Device attributes reach the user as Python attributes of the stock client's
device objects (``d.slice_index``), so the types matter: ints become int64,
strings bytes, lists of ints int64 lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pathways_nb.protocol import schema

AttributeValue = str | bytes | bool | int | float | Sequence[int]


def fill(proto, values: Mapping[str, AttributeValue]) -> None:
    """Writes ``values`` into an ``AttributeMapProto`` message in place."""
    for key, value in values.items():
        entry = proto.attributes[key]
        if isinstance(value, bool):
            entry.bool_value = value
        elif isinstance(value, int):
            entry.int64_value = value
        elif isinstance(value, float):
            entry.float_value = value
        elif isinstance(value, str):
            entry.string_value = value.encode()
        elif isinstance(value, bytes):
            entry.string_value = value
        else:
            entry.int64_list_value.elements.extend(int(v) for v in value)
            entry.int64_list_value.SetInParent()


def to_proto(values: Mapping[str, AttributeValue]):
    """A new ``AttributeMapProto`` holding ``values``."""
    proto = schema.load().ifrt.AttributeMapProto()
    fill(proto, values)
    return proto


def to_dict(proto) -> dict[str, AttributeValue]:
    """The attributes of an ``AttributeMapProto`` as a dict (strings decoded)."""
    result: dict[str, AttributeValue] = {}
    for key, value in proto.attributes.items():
        kind = value.WhichOneof("value")
        if kind == "string_value":
            result[key] = value.string_value.decode(errors="replace")
        elif kind == "int64_list_value":
            result[key] = list(value.int64_list_value.elements)
        elif kind is not None:
            result[key] = getattr(value, kind)
    return result
