"""Request bytes that are not a valid message get INVALID_ARGUMENT naming the field, not UNKNOWN.

grpc's generated handlers call `Message.FromString` before the servicer runs; when that raises
(a `string` field that is not UTF-8, a truncated message) grpc answers UNKNOWN with no detail.
`lenient` deserializes instead to an `Undecodable`, and `guard_*` wrap a servicer method so it
aborts with INVALID_ARGUMENT and the field's path, found by walking the wire format:

    tag (varint: field number << 3 | wire type) -> value; strings are length-delimited,
    nested messages too (walked with their own descriptor)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


@dataclass(frozen=True, slots=True)
class Undecodable:
    descriptor: Descriptor
    raw: bytes
    error: str

    def details(self) -> str:
        path = find_invalid_utf8(self.descriptor, self.raw)
        if path is not None:
            return f"{path}: is not valid UTF-8 (protobuf strings must be)"
        return f"the request is not a valid {self.descriptor.full_name}: {self.error}"


def lenient(message_class: Any) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return message_class.FromString(raw)
        except DecodeError as e:
            return Undecodable(message_class.DESCRIPTOR, raw, str(e))

    return deserialize


def guard_unary(method: Callable) -> Callable:
    async def behaviour(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details())
        return await method(request, context)

    return behaviour


def guard_stream(method: Callable) -> Callable:
    async def behaviour(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details())
        async for item in method(request, context):
            yield item

    return behaviour


def find_invalid_utf8(descriptor: Descriptor, raw: bytes, prefix: str = "") -> str | None:
    """The path ("chat.messages[1].content") of the first string field that is not UTF-8."""
    counts: dict[str, int] = {}
    pos = 0
    try:
        while pos < len(raw):
            tag, pos = _varint(raw, pos)
            number, wire = tag >> 3, tag & 7
            if wire == _VARINT:
                _, pos = _varint(raw, pos)
                continue
            if wire in (_I64, _I32):
                pos += 8 if wire == _I64 else 4
                continue
            if wire != _LEN:
                return None  # groups or garbage: nothing to name
            size, pos = _varint(raw, pos)
            value, pos = raw[pos:pos + size], pos + size
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            index = counts.get(field.name, 0)
            counts[field.name] = index + 1
            repeated = field.is_repeated
            path = f"{prefix}{field.name}" + (f"[{index}]" if repeated else "")
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    value.decode("utf-8")
                except UnicodeDecodeError:
                    return path
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = find_invalid_utf8(field.message_type, value, path + ".")
                if found is not None:
                    return found
    except IndexError:
        return None
    return None


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
