"""A zero-copy protobuf wire codec for the messages that carry large packed arrays.

Why not the generated classes for these: with the upb backend, building a message from a
16 MiB ``bytes`` value, serialising it, parsing it and reading the field back copies the payload
four to six times (measured: ~25 ms to build + serialise one 16 MiB PullSparseResponse on a
2-core CPU, vs 3.5 ms for one copy), which by itself halved the RPC throughput at dim 64
(``bench/bench_ps_rpc.py``). This module writes the same bytes in ONE copy (``bytes.join`` over
the numpy buffers) and parses into ``memoryview`` slices of the received message (no copy; numpy
reads them with ``np.frombuffer``).

The wire format is unchanged — it is protobuf, for the messages of ``ps.proto``, with field
numbers and types read from the generated descriptors — so any protobuf client interoperates,
and ``tests/test_ps_grpc_wire.py`` checks round trips against the generated classes. Supported
field types: string, bytes, bool, enum and unsigned integers (what these messages use); unknown
fields are skipped as protobuf does; a malformed body raises ``DecodeError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_LEN_TYPES = {FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES}
_VARINT_TYPES = {
    FieldDescriptor.TYPE_BOOL,
    FieldDescriptor.TYPE_ENUM,
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
}


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


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise DecodeError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise DecodeError("varint longer than 10 bytes")


class WireMessage:
    """Encoder and parser of one message type (the fields of its descriptor)."""

    def __init__(self, descriptor: Descriptor) -> None:
        self.name = descriptor.full_name
        self.fields: dict[int, FieldDescriptor] = {}
        for f in descriptor.fields:
            if f.type not in _LEN_TYPES | _VARINT_TYPES or f.is_repeated:
                raise TypeError(f"{self.name}.{f.name}: field type {f.type} is not supported")
            self.fields[f.number] = f
        self._by_name = {f.name: f for f in descriptor.fields}
        self._order = sorted(self.fields.values(), key=lambda f: f.number)

    def encode(self, values: Mapping[str, Any]) -> bytes:
        """The message bytes; ``bytes`` fields take any C-contiguous buffer (numpy arrays),
        defaults (0, empty, False) are left out as protobuf 3 does."""
        unknown = set(values) - set(self._by_name)
        if unknown:
            raise TypeError(f"{self.name} has no field(s) {sorted(unknown)}")
        parts: list[Any] = []
        for f in self._order:
            value = values.get(f.name)
            if f.type in _LEN_TYPES:
                if value is None:
                    continue
                if isinstance(value, str):
                    value = value.encode("utf-8")
                view = memoryview(value)
                if not view.c_contiguous:
                    raise ValueError(f"{self.name}.{f.name}: the buffer must be C-contiguous")
                if view.nbytes == 0:
                    continue
                parts += (_varint(f.number << 3 | _LEN), _varint(view.nbytes), view.cast("B"))
            elif value:
                parts += (_varint(f.number << 3 | _VARINT), _varint(int(value)))
        return b"".join(parts)

    def decode(self, data: bytes | memoryview) -> SimpleNamespace:
        """A namespace with every field: ``bytes`` fields as memoryview slices of ``data`` (no
        copy), strings as ``str``, the rest as ``int`` / ``bool``; absent fields default."""
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
        out: dict[str, Any] = {}
        pos, end = 0, len(view)
        while pos < end:
            key, pos = _read_varint(view, pos)
            number, wire_type = key >> 3, key & 7
            if number == 0:
                raise DecodeError("field number 0")
            if wire_type == _VARINT:
                value, pos = _read_varint(view, pos)
            elif wire_type == _LEN:
                size, pos = _read_varint(view, pos)
                if pos + size > end:
                    raise DecodeError(f"a {size}-byte field runs past the {end}-byte message")
                value, pos = view[pos : pos + size], pos + size
            elif wire_type == _I64:
                value, pos = None, pos + 8
            elif wire_type == _I32:
                value, pos = None, pos + 4
            else:
                raise DecodeError(f"unsupported wire type {wire_type}")
            if pos > end:
                raise DecodeError("truncated fixed-size field")
            f = self.fields.get(number)
            expected = _LEN if f is not None and f.type in _LEN_TYPES else _VARINT
            if f is None or wire_type != expected:
                continue  # unknown field (or another type under this number): skipped
            if f.type == FieldDescriptor.TYPE_STRING:
                try:
                    value = bytes(value).decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DecodeError(f"{f.name}: invalid UTF-8: {err}") from None
            elif f.type == FieldDescriptor.TYPE_BOOL:
                value = bool(value)
            elif f.type == FieldDescriptor.TYPE_UINT32:
                value &= 0xFFFFFFFF
            elif f.type == FieldDescriptor.TYPE_UINT64:
                value &= 0xFFFFFFFFFFFFFFFF
            out[f.name] = value
        for f in self._order:
            if f.name not in out:
                out[f.name] = (
                    ""
                    if f.type == FieldDescriptor.TYPE_STRING
                    else memoryview(b"")
                    if f.type == FieldDescriptor.TYPE_BYTES
                    else False
                    if f.type == FieldDescriptor.TYPE_BOOL
                    else 0
                )
        return SimpleNamespace(**out)


def wire_message(message_cls: Any) -> WireMessage:
    """The :class:`WireMessage` of a generated message class."""
    return WireMessage(message_cls.DESCRIPTOR)


__all__ = ["WireMessage", "wire_message"]
