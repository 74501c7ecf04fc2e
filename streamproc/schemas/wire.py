"""The Confluent Schema Registry wire format: ``0x00``, a 4-byte big-endian schema id, the
payload (Avro binary, Protobuf message indexes + message, or JSON)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TypeVar

from streamproc.errors import DecodeError, RecordError
from streamproc.records import Record

T = TypeVar("T")

MAGIC = 0
_HEADER = struct.Struct(">bI")
HEADER_SIZE = _HEADER.size  # 5 bytes


def split(value: bytes | None) -> tuple[int, memoryview]:
    """The schema id and the payload of a framed value (the payload is a view, not a copy).

    Raises:
        DecodeError: tombstone, a value shorter than the 5-byte header, or a first byte other
            than the magic byte 0 (``not in the schema registry wire format: ...``).
    """
    if value is None:
        raise DecodeError("tombstone record: value is null")
    if len(value) < HEADER_SIZE:
        raise DecodeError(
            f"not in the schema registry wire format: {len(value)} bytes, "
            f"shorter than the {HEADER_SIZE}-byte header"
        )
    magic, schema_id = _HEADER.unpack_from(value)
    if magic != MAGIC:
        raise DecodeError(
            f"not in the schema registry wire format: magic byte {magic & 0xFF}, expected {MAGIC}"
        )
    return schema_id, memoryview(value)[HEADER_SIZE:]


def frame(schema_id: int, payload: bytes) -> bytes:
    """``payload`` framed with ``schema_id`` (what a registry-aware serialiser writes)."""
    return _HEADER.pack(MAGIC, schema_id) + payload


def decode_each(
    records: Sequence[Record], decode: Callable[[bytes | None], T]
) -> tuple[list[int], list[T], dict[int, RecordError]]:
    """``decode`` of every record's value, as a workload's ``decode_many`` wants it.

    Returns:
        The indexes into ``records`` that decoded (ascending), their messages (same order),
        and per refused index its :class:`DecodeError`.

    Raises:
        RegistryUnavailable: from ``decode``: the registry did not answer before it was closed
            (no record is refused for it).
    """
    indexes: list[int] = []
    messages: list[T] = []
    failed: dict[int, RecordError] = {}
    for index, record in enumerate(records):
        try:
            message = decode(record.value)
        except DecodeError as exc:
            failed[index] = exc
            continue
        indexes.append(index)
        messages.append(message)
    return indexes, messages, failed


def zigzag(value: int) -> bytes:
    """``value`` as a zigzag varint (Avro's long, Protobuf's ``sint64`` and index paths)."""
    encoded = (value << 1) ^ (value >> 63)
    out = bytearray()
    while True:
        byte = encoded & 0x7F
        encoded >>= 7
        out.append(byte | (0x80 if encoded else 0))
        if not encoded:
            return bytes(out)


def read_zigzag(data: memoryview, pos: int) -> tuple[int, int]:
    """The zigzag varint at ``pos``: (value, next position).

    Raises:
        IndexError: truncated.
        ValueError: longer than a long's 10 bytes.
    """
    shift = result = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")
