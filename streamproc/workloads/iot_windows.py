"""The iot window straight from Avro or Protobuf bytes into numpy, without a dict or a list
per sample.

A decode plan per writer schema id (:class:`AvroWindows`): where the writer schema is the iot
reader schema itself (``schemas/iot.avsc``, the common case), a value is read by a cursor over
its bytes: ``device_id``, ``ts_ms`` and ``window_id`` as Avro's zigzag varints, ``channels``
compared byte for byte with their canonical encoding, and the 32 x 4 doubles of ``window`` taken
by one ``numpy.frombuffer`` of a structured dtype (each sample is an Avro array block: a count
byte 8, four little-endian doubles, the end byte 0). Anything else (another writer schema,
another block layout, a value the cursor does not recognise) goes the general way: fastavro,
the message Struct, the same checks as JSON. Protobuf likewise (:class:`ProtobufWindows`): in
the canonical serialisation (fields in number order, as protobuf writes them) the 32 ``Sample``
messages are 36 bytes each (tag, length, packed-field tag, length, four doubles). The fast way
only ever accepts what the general way accepts, with the same window
(tests/unit/schemas/test_iot_windows.py compares them on every recorded window and on mutated
values).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from streamproc.errors import DecodeError, RecordError
from streamproc.records import Record
from streamproc.schemas.avro import AvroDecoder
from streamproc.schemas.protobuf import ProtobufDecoder, read_indexes
from streamproc.schemas.wire import read_zigzag, split, zigzag

INT64_MIN = -(2**63)  # a long the message Struct refuses (its bound is -(2**63 - 1))


def _zigzag_string(text: str) -> bytes:
    data = text.encode()
    return zigzag(len(data)) + data


class Windows:
    """What both straight reads share: per record the straight read where its writer schema
    allows it, else the general way (the pipeline's decoder and the JSON path's checks)."""

    def __init__(self, general: Any, window: int, to_window: Callable[[Any], Any]) -> None:
        self.general = general
        self.window = window
        self.to_window = to_window

    def fast(self, schema_id: int) -> bool:
        raise NotImplementedError

    def read(self, payload: memoryview) -> np.ndarray | None:
        raise NotImplementedError

    def decode_windows(
        self, records: Sequence[Record]
    ) -> tuple[list[int], list[np.ndarray], dict[int, RecordError]]:
        """Per record its window: the indexes that decoded (ascending), their (window,
        channels) float64 values, and per refused index its :class:`DecodeError`.

        Raises:
            RegistryUnavailable: the registry did not answer before it was closed.
        """
        parsed: list[int] = []
        windows: list[np.ndarray] = []
        failed: dict[int, RecordError] = {}
        for index, record in enumerate(records):
            try:
                schema_id, payload = split(record.value)
                values = self.read(payload) if self.fast(schema_id) else None
                if values is None:
                    message = self.general.decode(record.value)
                    values = np.asarray(self.to_window(message), dtype=np.float64)
            except DecodeError as exc:
                failed[index] = exc
                continue
            parsed.append(index)
            windows.append(values)
        return parsed, windows, failed


class AvroWindows(Windows):
    """The windows of framed iot Avro values (thread-safe: per-id answers are only read once
    made).

    Args:
        general: the pipeline's :class:`AvroDecoder` of the iot message (plans, fallback).
        window: samples per window; channels: their names, in order.
        to_window: message -> its (window, channels) values, with the checks of the JSON
            path (raises DecodeError).
    """

    def __init__(
        self,
        general: AvroDecoder[Any],
        window: int,
        channels: Sequence[str],
        to_window: Callable[[Any], Any],
    ) -> None:
        super().__init__(general, window, to_window)
        count = zigzag(len(channels))
        self._channels = count + b"".join(map(_zigzag_string, channels)) + b"\x00"
        self._block = zigzag(window)[0] if window < 64 else None
        self._sample = np.dtype([("n", "u1"), ("v", "<f8", (len(channels),)), ("e", "u1")])
        self._sample_count = count[0]
        self._fast: dict[int, bool] = {}

    def fast(self, schema_id: int) -> bool:
        """Whether values of ``schema_id`` may be read straight (the writer is the reader)."""
        fast = self._fast.get(schema_id)
        if fast is None:
            plan = self.general.plan(schema_id)
            # the writer is the reader schema: the layout is known
            fast = plan.refusal is None and plan.reader is None and self._block is not None
            self._fast[schema_id] = fast
        return fast

    def read(self, payload: memoryview) -> np.ndarray | None:
        """The (window, channels) float64 values of one payload of the reader schema, or None
        where the general way must decide (anything but the canonical layout)."""
        try:
            length, pos = read_zigzag(payload, 0)  # device_id
            if length < 0 or pos + length > len(payload):
                return None
            bytes(payload[pos : pos + length]).decode()  # valid UTF-8, as fastavro requires
            pos += length
            ts_ms, pos = read_zigzag(payload, pos)
            branch = payload[pos]
            pos += 1
            if branch == 2:
                window_id, pos = read_zigzag(payload, pos)
                if window_id == INT64_MIN:
                    return None
            elif branch != 0:
                return None
            if ts_ms == INT64_MIN:
                return None
            end = pos + len(self._channels)
            if payload[pos:end] != self._channels:
                return None
            pos = end
            size = self._sample.itemsize * self.window
            if payload[pos] != self._block or len(payload) != pos + 1 + size + 1 or payload[-1]:
                return None
            samples = np.frombuffer(payload, self._sample, self.window, pos + 1)
            if (samples["n"] != self._sample_count).any() or samples["e"].any():
                return None
            values: np.ndarray = samples["v"]
            return values
        except (IndexError, ValueError, UnicodeDecodeError):
            return None


def _uvarint(data: memoryview, pos: int) -> tuple[int, int]:
    """A protobuf varint at ``pos`` as a signed 64-bit integer: (value, next position)."""
    shift = result = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result - (1 << 64) if result >= 1 << 63 else result), pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


class ProtobufWindows(Windows):
    """The windows of framed iot Protobuf values (``SensorWindow``), as :class:`AvroWindows`
    for Avro (thread-safe)."""

    def __init__(
        self,
        general: ProtobufDecoder[Any],
        window: int,
        channels: Sequence[str],
        to_window: Callable[[Any], Any],
    ) -> None:
        super().__init__(general, window, to_window)
        self._channels = b"".join(b"\x22" + bytes([len(c)]) + c.encode() for c in channels)
        width = len(channels) * 8
        self._sample = np.dtype(
            [("tag", "u1"), ("size", "u1"), ("packed", "u1"), ("bytes", "u1"),
             ("v", "<f8", (len(channels),))]
        )  # fmt: skip
        self._expected = (0x2A, width + 2, 0x0A, width)

    def read(self, payload: memoryview) -> np.ndarray | None:
        """The (window, channels) float64 values of one payload in the canonical layout, or
        None where the general way must decide."""
        try:
            _, pos = read_indexes(payload)
            if payload[pos] != 0x0A:  # device_id
                return None
            length, pos = _uvarint(payload, pos + 1)
            if length < 0 or pos + length > len(payload):
                return None
            bytes(payload[pos : pos + length]).decode()  # valid UTF-8, as protobuf requires
            pos += length
            for tag in (0x10, 0x18):  # ts_ms, window_id: optional on the wire
                if payload[pos] == tag:
                    value, pos = _uvarint(payload, pos + 1)
                    if value == INT64_MIN:
                        return None
            end = pos + len(self._channels)
            if payload[pos:end] != self._channels:
                return None
            if len(payload) != end + self._sample.itemsize * self.window:
                return None
            samples = np.frombuffer(payload, self._sample, self.window, end)
            tag, size, packed, count = self._expected
            if (
                (samples["tag"] != tag).any()
                or (samples["size"] != size).any()
                or (samples["packed"] != packed).any()
                or (samples["bytes"] != count).any()
            ):
                return None
            values: np.ndarray = samples["v"]
            return values
        except (IndexError, ValueError, UnicodeDecodeError, DecodeError):
            return None

    def fast(self, schema_id: int) -> bool:
        """Whether values of ``schema_id`` may be read straight (a Protobuf writer schema)."""
        return self.general.refusal(schema_id) is None
