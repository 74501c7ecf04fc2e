"""The Kafka headers streamproc writes: their names, and the builders of their values.

Every result and dead-letter record carries the source coordinates of its input:
``streamproc.source.topic``, ``streamproc.source.partition`` and ``streamproc.source.offset``
(ASCII decimal). A result adds ``streamproc.timing`` (:data:`TIMING_FORMAT`) and
``streamproc.model.version`` (the version that made it), then the workload's own headers. A
dead-letter record keeps the input's headers first, then adds the source coordinates and
``streamproc.error.stage`` (decode|model|encode|produce|callback|deadline|delivery),
``streamproc.error.class`` and ``streamproc.error.message`` (the Kafka Connect dead-letter
convention, our prefix), and ``streamproc.error.value_omitted`` (the value's size in bytes) when
its value was left out. An *expired* result (its input was past its deadline when its batch was
cut, and ``pipelines[].on_expired`` is ``result``) has an empty value and carries the source
coordinates and ``streamproc.result.kind: expired`` only. Names and values are a contract:
consumers of the output topics read them.
"""

from __future__ import annotations

from collections.abc import Sequence

from streamproc.records import Headers, Record
from streamproc.tracing.context import TRACE_HEADERS

H_TOPIC = "streamproc.source.topic"
H_PARTITION = "streamproc.source.partition"
H_OFFSET = "streamproc.source.offset"
H_STAGE = "streamproc.error.stage"
H_CLASS = "streamproc.error.class"
H_MESSAGE = "streamproc.error.message"
H_VALUE_OMITTED = "streamproc.error.value_omitted"
H_TIMING = "streamproc.timing"
H_MODEL_VERSION = "streamproc.model.version"
"""The model version that made a result (``builtin``: the workload's own model)."""
TIMING_FORMAT = b"queue_wait_ms=%.3f;inference_ms=%.3f;processing_ms=%.3f"
"""The value of the ``streamproc.timing`` header on every result: milliseconds the input
waited in its ring (consumed -> batch cut), the batch's device time, and consumed -> result
produced (:func:`parse_timing` reads it back)."""
H_RESULT_KIND = "streamproc.result.kind"
"""On an expired result only: :data:`KIND_EXPIRED` (a result made by the model has none)."""
KIND_EXPIRED = b"expired"
"""The ``streamproc.result.kind`` value of a result whose input was not run: past its deadline."""
EXPIRED = (H_RESULT_KIND, KIND_EXPIRED)
"""The header that marks an expired result."""
STAGE_DEADLINE = "deadline"
"""The ``streamproc.error.stage`` of a dead-letter record whose input was past its deadline."""
STAGE_DELIVERY = "delivery"
"""The ``streamproc.error.stage`` of a dead-letter record whose input a share group delivered
``kafka.share_max_deliveries`` times (each earlier member failed to finish it: a crash, a kill,
a lock that ran out); it is not run again (``streamproc.share``)."""
MAX_ERROR_MESSAGE_CHARS = 1000
"""``streamproc.error.message`` holds at most this many characters of the error's message."""

OutputHeaders = list[tuple[str, bytes]]
"""The complete headers of one output record, in the order they are produced."""


def parse_timing(value: bytes) -> dict[str, float]:
    """The ``streamproc.timing`` header as ``{"queue_wait_ms": ..., "inference_ms": ...,
    "processing_ms": ...}`` (milliseconds).

    Raises:
        ValueError: not ``name=number`` pairs separated by ``;``.
    """
    timings: dict[str, float] = {}
    for part in value.decode("ascii").split(";"):
        name, sep, number = part.partition("=")
        if not sep:
            raise ValueError(f"not a streamproc.timing header: {value!r}")
        timings[name] = float(number)
    return timings


def source_headers(record: Record) -> Headers:
    """The source-coordinate headers of ``record`` (topic, partition, offset)."""
    return (
        (H_TOPIC, record.tp.topic.encode()),
        (H_PARTITION, b"%d" % record.tp.partition),
        (H_OFFSET, b"%d" % record.offset),
    )


def dead_letter_headers(
    record: Record,
    stage: str,
    error_class: str,
    message: str,
    value_omitted: bool,
    trace: Headers = (),
) -> OutputHeaders:
    """The headers of ``record``'s dead-letter record: its own headers, its source
    coordinates, the error's stage, class and message (at most
    :data:`MAX_ERROR_MESSAGE_CHARS` characters; unencodable ones replaced), and, when
    ``value_omitted``, the size in bytes of the value left out. ``trace``: the dead-letter
    record's own trace headers (``streamproc.tracing``), which replace the input's."""
    kept = record.headers
    if trace:
        kept = tuple(h for h in kept if h[0] not in TRACE_HEADERS)
    headers = [
        *kept,
        *trace,
        *source_headers(record),
        (H_STAGE, stage.encode()),
        (H_CLASS, error_class.encode()),
        (H_MESSAGE, message[:MAX_ERROR_MESSAGE_CHARS].encode(errors="replace")),
    ]
    if value_omitted:
        headers.append((H_VALUE_OMITTED, b"%d" % len(record.value or b"")))
    return headers


class ResultHeaders:
    """Builds the headers of one input topic's results. Not thread-safe: the lane's results
    thread owns it (it keeps each partition's two coordinate headers, built once).

    Args:
        input_topic: the topic every record handed to :meth:`build` was consumed from.
    """

    def __init__(self, input_topic: str) -> None:
        self._topic = input_topic.encode()
        self._coordinates: dict[int, tuple[tuple[str, bytes], tuple[str, bytes]]] = {}

    def _prefix(self, partition: int) -> tuple[tuple[str, bytes], tuple[str, bytes]]:
        """The topic and partition headers of ``partition``'s records (built once)."""
        prefix = self._coordinates.get(partition)
        if prefix is None:
            prefix = self._coordinates[partition] = (
                (H_TOPIC, self._topic),
                (H_PARTITION, b"%d" % partition),
            )
        return prefix

    def expired(self, records: Sequence[Record]) -> list[OutputHeaders]:
        """The headers of each record's expired result, in order: source coordinates, then
        ``streamproc.result.kind: expired``. Shedding under overload makes one per record, so
        the coordinate headers are shared, not built per record."""
        coordinates = self._coordinates
        prefix_of = self._prefix
        built: list[OutputHeaders] = []
        for record in records:
            partition = record.tp.partition
            prefix = coordinates.get(partition) or prefix_of(partition)
            built.append([*prefix, (H_OFFSET, b"%d" % record.offset), EXPIRED])
        return built

    def build(
        self,
        records: Sequence[Record],
        extra: Sequence[Headers],
        cut_at_s: float,
        inference_ms: float,
        now_s: float,
        version: bytes = b"builtin",
    ) -> list[OutputHeaders]:
        """The headers of each record's result, in order: source coordinates,
        ``streamproc.timing``, ``streamproc.model.version``, then that result's ``extra``
        headers.

        Args:
            records: the inputs (``consumed_at_s`` on the ``time.monotonic()`` clock).
            extra: per record, the workload's headers of its result.
            cut_at_s: when the batch was cut (``time.monotonic()``).
            inference_ms: the batch's device time, in milliseconds.
            now_s: the time the results are produced (``time.monotonic()``).
            version: the model version that made the batch's results.

        Raises:
            ValueError: ``records`` and ``extra`` differ in length.
        """
        coordinates = self._coordinates
        made_by = (H_MODEL_VERSION, version)
        # the timing header depends on the record only through its consume time, which the
        # records of one poll share: formatted once per poll in the batch, not per record
        timings: dict[float, tuple[str, bytes]] = {}
        built: list[OutputHeaders] = []
        for record, more in zip(records, extra, strict=True):
            partition = record.tp.partition
            prefix = coordinates.get(partition) or self._prefix(partition)
            consumed_at_s = record.consumed_at_s
            timing = timings.get(consumed_at_s)
            if timing is None:  # the first record of its poll in this batch
                timing = timings[consumed_at_s] = (
                    H_TIMING,
                    TIMING_FORMAT
                    % (
                        (cut_at_s - consumed_at_s) * 1000,
                        inference_ms,
                        (now_s - consumed_at_s) * 1000,
                    ),
                )
            headers = [*prefix, (H_OFFSET, b"%d" % record.offset), timing, made_by]
            if more:
                headers.extend(more)
            built.append(headers)
        return built
