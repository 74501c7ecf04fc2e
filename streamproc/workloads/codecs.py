"""Typed JSON decoding and encoding for the light workloads (trades, iot), at native speed.

A schema is a :class:`msgspec.Struct` whose fields carry their constraints
(``Annotated[float, msgspec.Meta(gt=0)]``); :class:`StrictJsonDecoder` builds its msgspec
decoders once and turns one record value into one Struct, or raises
:class:`~streamproc.errors.DecodeError` with the reason the dead-letter record carries::

    malformed JSON: <what the parser refused>        not RFC 8259 JSON, or trailing garbage
    schema: <what was wrong> - at `$.<field>`        a missing, mistyped or out-of-range field

What msgspec checks natively (measured, msgspec 0.23): RFC 8259 syntax (no ``NaN``/``Infinity``
literals, comments, trailing commas, leading zeros, control characters in strings, invalid UTF-8,
lone surrogate escapes, trailing characters); strict types (``true`` is not a float, ``"1"`` is
not an int, ``3.0`` is not an int; an integer is a valid float); a float field refuses a number
beyond the float range (``1e999``; reported as ``malformed JSON: number beyond the float
range - at `$.price```, as orjson did) and ``Meta`` bounds (``gt``, ``le``,
``min_length``); ``Literal`` values; missing required fields.

What it does not, and this module adds: msgspec skips the value of a field the schema does not
name without checking its numbers (``"note": 1e400``) or the UTF-8 of its strings, and an
``int`` field takes any size of integer unless bounded (schemas bound theirs with
:data:`INT64`). A message that names only schema fields (every real message) costs one
decode; one with extra fields is decoded leniently and its whole document checked with orjson
(the parser the workloads used before msgspec, which refuses those), so such a message is
accepted exactly when it was before.

Results are msgspec Structs too, serialised by :data:`RESULT_ENCODER` (built once; measured
faster than building a dict for ``orjson.dumps``, benchmarks/codecs.py);
:class:`SourceCoordinates` is their ``source`` field. One decoder or encoder instance serves
every decode and results thread (msgspec keeps no state between calls; 8 threads sharing one
gave the serial results).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Generic, TypeVar, cast

import msgspec
import numpy as np
import orjson

from streamproc.errors import DecodeError, EncodeError, RecordError
from streamproc.records import Record
from streamproc.workloads.base import Encoded, require_value

S = TypeVar("S", bound=msgspec.Struct)
H = TypeVar("H", bound=msgspec.Struct)

INT64_MAX = 2**63 - 1
INT64 = Annotated[int, msgspec.Meta(ge=-INT64_MAX, le=INT64_MAX)]
"""An integer in ``[-(2**63 - 1), 2**63 - 1]``: what float64 features and the encoders take."""

RESULT_ENCODER = msgspec.json.Encoder()
"""Serialises result Structs to JSON bytes (floats shortest round-trip, NaN and inf as null)."""

_MALFORMED_PREFIX = "JSON is malformed: "
_OUT_OF_RANGE = "Number out of range"


class SourceCoordinates(msgspec.Struct, gc=False):
    """The input record's coordinates in a result body (``"source": {"topic", "partition",
    "offset"}``, as :func:`~streamproc.workloads.base.source_coordinates`)."""

    topic: str
    partition: int
    offset: int

    @classmethod
    def of(cls, record: Record) -> SourceCoordinates:
        """The coordinates of ``record``."""
        return cls(record.tp.topic, record.tp.partition, record.offset)


class StrictJsonDecoder(Generic[S]):
    """Decode record values into ``schema`` instances (decoders built once; thread-safe).

    Two msgspec decoders: a closed one (a subclass of ``schema`` with
    ``forbid_unknown_fields=True``) that every real message passes in one call, and an open
    one, tried only after the closed one refused: it either says what is wrong, or accepts a
    message with extra fields, whose whole document orjson then checks.

    Args:
        schema: a :class:`msgspec.Struct` class (unknown fields allowed, i.e. the default
            ``forbid_unknown_fields=False``); its instances are what :meth:`decode` returns.
    """

    def __init__(self, schema: type[S]) -> None:
        self.schema = schema
        closed = types.new_class(
            f"Closed{schema.__name__}", (schema,), {"forbid_unknown_fields": True}
        )
        self._closed = msgspec.json.Decoder(cast(type[S], closed))
        self._open = msgspec.json.Decoder(schema)

    def decode(self, value: bytes) -> S:
        """The ``schema`` instance that ``value`` (JSON bytes) holds.

        Raises:
            DecodeError: ``malformed JSON: ...`` (not RFC 8259 JSON, trailing characters,
                a number beyond the float range anywhere in the document) or ``schema: ...``
                (what msgspec says, with the field's path).
        """
        try:
            return self._closed.decode(value)
        except (msgspec.DecodeError, RecursionError):
            return self._decode_open(value)  # an extra field, or a bad message

    def decode_record(self, record: Record) -> S:
        """:meth:`decode` of the record's value.

        Raises:
            DecodeError: tombstone (null value), empty value, or as :meth:`decode`.
        """
        return self.decode(require_value(record))

    def decode_records(
        self, records: Sequence[Record]
    ) -> tuple[list[int], list[S], dict[int, RecordError]]:
        """:meth:`decode_record` of every record (what a workload's ``decode_many`` calls).

        Returns:
            The indexes into ``records`` that decoded (ascending), their messages (same
            order), and per refused index its :class:`DecodeError`.
        """
        closed = self._closed.decode
        indexes: list[int] = []
        messages: list[S] = []
        failed: dict[int, RecordError] = {}
        for index, record in enumerate(records):
            try:
                value = require_value(record)
                try:
                    message = closed(value)
                except (msgspec.DecodeError, RecursionError):
                    message = self._decode_open(value)  # an extra field, or a bad message
            except DecodeError as exc:
                failed[index] = exc
                continue
            indexes.append(index)
            messages.append(message)
        return indexes, messages, failed

    def _decode_open(self, value: bytes) -> S:
        """:meth:`decode` of a value the closed decoder refused: extra fields, or bad."""
        try:
            message = self._open.decode(value)
        except msgspec.ValidationError as exc:
            raise _schema_error(exc) from exc
        except msgspec.DecodeError as exc:
            raise DecodeError(
                f"malformed JSON: {str(exc).removeprefix(_MALFORMED_PREFIX)}"
            ) from exc
        except RecursionError as exc:
            raise DecodeError("malformed JSON: nested too deep") from exc
        try:  # the extra fields msgspec skipped unchecked
            orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise DecodeError(f"malformed JSON: {exc}") from exc
        return message


def _schema_error(exc: msgspec.ValidationError) -> DecodeError:
    """``schema: <msgspec's message>``; a number beyond the float range in a float field stays
    ``malformed JSON`` (what orjson called it, and what docs/workloads.md promises)."""
    text = str(exc)
    if text.startswith(_OUT_OF_RANGE):
        return DecodeError(
            f"malformed JSON: number beyond the float range{text.removeprefix(_OUT_OF_RANGE)}"
        )
    return DecodeError(f"schema: {text}")


def encode_results(
    records: Sequence[Record],
    rows: Iterable[tuple[Any, ...]],
    read_head: Callable[[bytes], H],
    build: Callable[..., msgspec.Struct],
    encode: Callable[[msgspec.Struct], bytes] = RESULT_ENCODER.encode,
) -> list[Encoded | Exception]:
    """One JSON result per record, for a workload's ``encode_many``.

    Per record: its echoed fields are read back from its value with ``read_head`` (the
    workload's input format: a JSON decoder of a small Struct, the other fields skipped, not
    parsed; or the Avro decoder's fields), its result Struct is
    ``build(head_struct, record, *row)`` with the matching ``row`` of model outputs (Python
    numbers), and ``encode`` serialises it (:data:`RESULT_ENCODER`: JSON; or the workload's
    output format, e.g. framed Avro).

    Returns:
        Per record, its :class:`Encoded` value, or in its place an :class:`EncodeError` (the
        value does not hold the echoed fields) or the exception ``build`` raised.
    """
    results: list[Encoded | Exception] = []
    for record, row in zip(records, rows, strict=True):
        try:
            value = encode(build(read_head(record.value or b""), record, *row))
        except (msgspec.DecodeError, msgspec.ValidationError, DecodeError) as exc:
            results.append(EncodeError(f"cannot read back the echoed fields: {exc}"))
            continue
        except Exception as exc:
            results.append(exc)
            continue
        results.append(Encoded(value))
    return results


def store_finite(
    rows: np.ndarray,
    values: np.ndarray,
    parsed: list[int],
    count: int,
    failed: dict[int, RecordError],
    reason: str,
) -> dict[int, RecordError]:
    """Write the decoded ``values`` into the slab ``rows`` and refuse the non-finite ones.

    Args:
        rows: the slice's slab rows, (count, *item_shape), the workload's dtype.
        values: one row per decoded record, (len(parsed), *item_shape), already in that dtype
            (a value beyond its range is inf here).
        parsed: the slice index of each row of ``values``, ascending.
        count: records in the slice.
        failed: the slice's failures so far; a row with a non-finite value is added with
            ``DecodeError(reason)`` and its slab row is left unwritten.

    Returns:
        ``failed``.
    """
    finite = np.isfinite(values).all(axis=tuple(range(1, values.ndim)))
    if not finite.all():
        for position in np.flatnonzero(~finite).tolist():
            failed[parsed[position]] = DecodeError(reason)
        parsed = [i for i, ok in zip(parsed, finite.tolist(), strict=True) if ok]
        values = values[finite]
    if len(parsed) == count:
        rows[...] = values
    else:
        rows[parsed] = values
    return failed


def encode_one(
    encode_many: Callable[[Sequence[Record], tuple[np.ndarray, ...]], list[Encoded | Exception]],
    record: Record,
    outputs: tuple[np.ndarray, ...],
) -> Encoded:
    """A workload's ``encode`` through its ``encode_many`` (``outputs``: one row per output).

    Raises:
        Exception: what ``encode_many`` put in the record's place.
    """
    result = encode_many([record], tuple(np.asarray(out)[None] for out in outputs))[0]
    if isinstance(result, Exception):
        raise result
    return result
