"""Record deadlines: when a consumed record's result stops being worth computing (pure).

A record's deadline comes from its ``streamproc.deadline`` header (epoch milliseconds, ASCII
decimal, set by the producer) or from its pipeline's ``max_age_ms`` (milliseconds after the
record's Kafka timestamp); where both apply, the earlier one. Both are wall-clock epoch
milliseconds, the clock of the record timestamps, while the batcher runs on the monotonic clock:
the source converts a record's deadline once, at intake, into ``Record.deadline_s``
(``time.monotonic()`` seconds; ``math.inf``: none), with one wall-clock reading per poll.

A record whose deadline has passed when its batch is cut is not run on the device: its batch
carries it as *expired* (``Batch.expired``) and the result handler produces an ``expired``
result or a dead-letter record for it (``pipelines[].on_expired``; docs/guarantees.md). It never
takes a live record's place: the cut takes past it (``Lane.next_cut``, at most
``MAX_EXPIRED_PER_CUT`` expired records per cut). With ``pipelines[].expire_when: predicted`` a
record also expires when its batch is expected to be acknowledged after its deadline
(``Batcher.expiry_lead_s``).

Bad input (:func:`parse_deadline_ms`): a header that is not 1 to :data:`MAX_DEADLINE_DIGITS`
ASCII digits, or that names an instant more than :data:`DEADLINE_SANE_RANGE_MS` away from the
record's own timestamp (a deadline in seconds or microseconds by mistake, or in 1970), is
ignored, as if the record had none (``max_age_ms`` still applies), and counted in
``streamproc_deadline_header_invalid_total{topic}``: a producer's unit mistake must not expire
all of its traffic, nor keep it for ever.
"""

from __future__ import annotations

import math

from streamproc.records import Headers

DEADLINE_HEADER = "streamproc.deadline"
"""The input header that sets a record's deadline: epoch milliseconds, ASCII decimal."""
MAX_DEADLINE_DIGITS = 16
"""A deadline header longer than this many digits is invalid (epoch ms have 13 today)."""
DEADLINE_SANE_RANGE_MS = 365 * 24 * 3600 * 1000
"""A deadline header further than this (one year, in ms) from the record's own timestamp is
invalid: a unit mistake (seconds, microseconds) or a zero, not a deadline."""

INVALID = -1
"""What :func:`parse_deadline_ms` returns for a header that does not parse."""


def parse_deadline_ms(value: bytes | None, timestamp_ms: int) -> int:
    """The deadline a ``streamproc.deadline`` header value names, in epoch milliseconds.

    Args:
        value: the header's value bytes (None: no value).
        timestamp_ms: the record's Kafka timestamp (epoch ms; <= 0: unknown, then only the
            syntax is checked).

    Returns:
        The deadline (epoch ms, >= 0), or :data:`INVALID` for a value that is not 1 to
        :data:`MAX_DEADLINE_DIGITS` ASCII digits or lies more than
        :data:`DEADLINE_SANE_RANGE_MS` from ``timestamp_ms``. Never raises.
    """
    if not value or len(value) > MAX_DEADLINE_DIGITS or not value.isdigit():
        return INVALID  # bytes.isdigit: ASCII digits only; no sign, space or "1e3"
    deadline_ms = int(value)
    if timestamp_ms > 0 and abs(deadline_ms - timestamp_ms) > DEADLINE_SANE_RANGE_MS:
        return INVALID
    return deadline_ms


class Deadlines:
    """One lane's deadline rule at intake: header and ``max_age_ms``, to monotonic seconds.

    Args:
        max_age_ms: the pipeline's ``max_age_ms`` (None: only the header sets deadlines).
    """

    __slots__ = ("max_age_ms",)

    def __init__(self, max_age_ms: int | None = None) -> None:
        if max_age_ms is not None and max_age_ms <= 0:
            raise ValueError(f"max_age_ms must be > 0, got {max_age_ms}")
        self.max_age_ms = max_age_ms

    def deadline_s(
        self,
        headers: Headers,
        timestamp_ms: int,
        wall_ms: float,
        mono_s: float,
    ) -> tuple[float, bool]:
        """A record's deadline on the monotonic clock.

        Args:
            headers: the record's headers (scanned only when not empty).
            timestamp_ms: its Kafka timestamp (epoch ms; <= 0: unknown, no ``max_age_ms``).
            wall_ms: ``time.time() * 1000`` read once for the poll.
            mono_s: ``time.monotonic()`` read at the same moment (the record's consume time).

        Returns:
            ``(deadline_s, header_invalid)``: the deadline in monotonic seconds
            (``math.inf``: none), and whether a ``streamproc.deadline`` header was present but
            invalid (then ignored; the caller counts it).
        """
        deadline_ms = math.inf
        if self.max_age_ms is not None and timestamp_ms > 0:
            deadline_ms = timestamp_ms + self.max_age_ms
        invalid = False
        for key, value in headers:
            if key == DEADLINE_HEADER:
                parsed = parse_deadline_ms(value, timestamp_ms)
                if parsed == INVALID:
                    invalid = True
                elif parsed < deadline_ms:
                    deadline_ms = parsed
                break
        if deadline_ms == math.inf:
            return math.inf, invalid
        return mono_s + (deadline_ms - wall_ms) / 1000.0, invalid
