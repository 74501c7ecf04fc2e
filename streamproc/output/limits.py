"""How large an output record may be: the producer's ``message.max.bytes`` and each output and
dead-letter topic's ``max.message.bytes`` (learned at start-up).

A result whose record cannot fit its topic even before compression is dead-lettered at once when
the producer does not compress (the broker judges the record batch as sent); when it compresses,
the result is only *at risk* and the processing guarantee decides (``Guarantee.plan``). A
dead-letter value that cannot fit is left out up front, so it never shares a refused request
with records that would fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from streamproc.output.acks import Row
from streamproc.output.headers import OutputHeaders
from streamproc.records import Record

DEAD_LETTER_OVERHEAD_BYTES = 8 * 1024
"""Key, headers (error message included) and record-batch framing of a dead-letter record."""
RECORD_BATCH_HEADER_BYTES = 61
"""A record batch's header (magic v2): the least framing a record pays on top of its bytes."""
RESULT_SLACK_BYTES = 16 * 1024
"""Results whose value is within this of the output topic's limit have their whole record (key,
headers) measured; smaller ones cannot be over it unless key and headers are huge."""

TooLarge = dict[Row, tuple[str, str]]
"""Rows that cannot fit, with the error class and message of their dead-letter record."""


class RecordLimits:
    """The record size limits of the sink's producer and topics.

    Args:
        settings: the results producer's librdkafka settings (``message.max.bytes``,
            ``compression.type`` or ``compression.codec``).
    """

    def __init__(self, settings: Mapping[str, Any]) -> None:
        # A larger value cannot be produced at all (a near one fails and is retried without).
        self._max_value_bytes = int(settings.get("message.max.bytes", 1_000_000))
        codec = settings.get("compression.type", settings.get("compression.codec", "none"))
        self._compressed = str(codec) != "none"
        self._topics: dict[str, int] = {}

    def set_topics(self, limits: Mapping[str, int]) -> None:
        """Per topic, its ``max.message.bytes``; call before any other thread reads the limits
        (they are read without a lock)."""
        self._topics = dict(limits)

    def dead_letter_value_fits(self, topic: str, value_bytes: int) -> bool:
        """True when a dead-letter value of ``value_bytes`` bytes fits a record to ``topic``
        (the producer's limit and the topic's, less :data:`DEAD_LETTER_OVERHEAD_BYTES`)."""
        limit = min(self._max_value_bytes, self._topics.get(topic, 1 << 62))
        return value_bytes <= limit - DEAD_LETTER_OVERHEAD_BYTES

    def oversized(
        self,
        topic: str,
        records: Sequence[Record],
        values: Sequence[bytes],
        headers: Sequence[OutputHeaders],
    ) -> tuple[TooLarge, list[Row]]:
        """Results too large for ``topic``'s ``max.message.bytes`` before compression.

        Returns:
            The rows that cannot fit at all (the producer does not compress), with the error
            class and message of their dead-letter record; and the rows at risk (it
            compresses: the broker judges the compressed record batch). Both empty when the
            topic's limit is unknown.
        """
        limit = self._topics.get(topic)
        if limit is None or not values or max(map(len, values)) <= limit - RESULT_SLACK_BYTES:
            return {}, []
        too_large: TooLarge = {}
        at_risk: list[Row] = []
        for row, value in enumerate(values):
            size = (
                RECORD_BATCH_HEADER_BYTES
                + len(value)
                + len(records[row].key or b"")
                + sum(len(k) + len(v) for k, v in headers[row])
            )
            if size <= limit:
                continue
            if self._compressed:
                at_risk.append(row)
                continue
            too_large[row] = (
                "KafkaError.MSG_SIZE_TOO_LARGE",
                f"Message size too large: the result's record ({size} bytes, uncompressed) "
                f"exceeds max.message.bytes ({limit}) of topic {topic!r}; not produced",
            )
        return too_large, at_risk
