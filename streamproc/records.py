"""Immutable values that cross stage boundaries.

A :class:`Record` is created by the source for every consumed Kafka message and travels, unchanged,
through the ring buffer, the batcher, the device worker and the sink until its offset is marked
done in the offset tracker. ``generation`` ties it to the partition assignment it was consumed
under, so a late result for a partition we no longer own is recognised and not committed.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

Headers = tuple[tuple[str, bytes], ...]


class Trace(Protocol):
    """A batch's trace as the stages see it (:class:`streamproc.tracing.batch.BatchTrace`)."""

    @property
    def exemplar(self) -> dict[str, str] | None:
        """The exemplar labels of the batch's latency observations (its sampled trace id)."""
        ...

    def out(self, record: Record, topic: str) -> Headers:
        """The trace headers of ``record``'s output record to ``topic``."""
        ...

    def device_time(self, seconds: float) -> None:
        """The batch's measured device time."""
        ...

    def finish(self, end_s: float | None = None) -> None:
        """End the batch's trace (idempotent)."""
        ...

    def fail(self, error: BaseException) -> None:
        """End the batch's trace now with an error status: ``error`` stopped its results on
        the way to the producer (idempotent)."""
        ...


class Laps(Protocol):
    """A batch's stage clock as the stages see it (:class:`streamproc.stages.StageClock`)."""

    @property
    def trace(self) -> Trace | None:
        """The batch's trace (None: not traced)."""
        ...

    def lap(self, stage: str) -> float:
        """``stage`` ended now: count its seconds once per record; returns now (monotonic
        seconds)."""
        ...


PRIORITY_HEADER = "priority"
"""The message header that sets a record's priority class (``high``, ``normal`` or ``low``)."""


class Priority(enum.IntEnum):
    """A record's priority class; the value indexes per-class tables (max waits, ring queues).

    Config values and the ``priority`` header spell it by name in lower case
    (:meth:`parse`); a lower value is more urgent.
    """

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @classmethod
    def parse(cls, value: Priority | str) -> Priority:
        """``"high"`` -> :attr:`HIGH`, ...; a :class:`Priority` is returned as it is.

        Raises:
            ValueError: ``value`` is not one of ``high``, ``normal``, ``low``.
        """
        if isinstance(value, Priority):
            return value
        member = _PRIORITY_NAMES.get(value)
        if member is None:
            raise ValueError(f"unknown priority {value!r}; allowed: {list(_PRIORITY_NAMES)}")
        return member

    @property
    def label(self) -> str:
        """The lower-case name config and the ``priority`` header use."""
        return self.name.lower()

    @classmethod
    def of(cls, headers: Headers, default: Priority) -> Priority:
        """The class a message's ``priority`` header names, else ``default`` (also for an
        unknown header value: a bad header never costs the message)."""
        for key, value in headers:
            if key == PRIORITY_HEADER:
                return PRIORITY_HEADER_VALUES.get(value, default)
        return default


_PRIORITY_NAMES = {p.name.lower(): p for p in Priority}
PRIORITY_HEADER_VALUES = {name.encode(): p for name, p in _PRIORITY_NAMES.items()}
"""The ``priority`` header's values (``b"high"``, ...) and their classes."""


class TopicPartition(NamedTuple):
    """A Kafka topic partition."""

    topic: str
    partition: int


@dataclass(slots=True, eq=False)
class Record:
    """One consumed Kafka message. Treated as immutable once created.

    Not a frozen dataclass on purpose: one is built per consumed message, and a frozen one is
    several times slower to build (docs/benchmarks-history.md). Equality is identity: two records
    are the same message only if they are the same object.

    Attributes:
        tp: source topic partition.
        offset: source offset.
        key: message key bytes, or None.
        value: message value bytes, or None for a tombstone.
        headers: message headers as ``(name, value bytes)`` pairs.
        timestamp_ms: the record's Kafka timestamp (ms since the epoch; CreateTime as produced).
        consumed_at_s: ``time.monotonic()`` when the source polled it; batch deadlines count
            from here.
        generation: the assignment generation of ``tp`` when consumed.
        priority: its class (from the ``priority`` header, else the lane's default).
        deadline_s: ``time.monotonic()`` seconds after which its result is no longer wanted
            (from the ``streamproc.deadline`` header or the pipeline's ``max_age_ms``,
            converted at intake: ``streamproc.intake.deadlines``); ``math.inf``: none.
    """

    tp: TopicPartition
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers
    timestamp_ms: int
    consumed_at_s: float
    generation: int = 0
    priority: Priority = Priority.NORMAL
    deadline_s: float = math.inf

    @property
    def size_bytes(self) -> int:
        """Size of key plus value in bytes."""
        return len(self.key or b"") + len(self.value or b"")

    def header(self, name: str) -> bytes | None:
        """Return the first header named ``name``, or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def where(self) -> dict[str, str | int]:
        """``topic``, ``partition`` and ``offset``: the fields a log line names a record by."""
        return {"topic": self.tp.topic, "partition": self.tp.partition, "offset": self.offset}


@dataclass(frozen=True, slots=True)
class Batch:
    """Records cut together by the batcher, in the order the batcher chose.

    ``records`` are the rows the device runs; ``expired`` the records of the same cut already
    past their deadline (``Record.deadline_s``) at the cut: never run, they get an ``expired``
    result or a dead-letter record from the result handler. A batch is never empty (checked):
    ``records`` is empty only where every record of the cut expired (such a batch never reaches
    a device). Per partition, records (and expired records) are in offset order. ``priority``
    is the most urgent class among its records (device admission orders lanes by it; see
    :mod:`streamproc.dispatch.admission`). ``len(batch)`` counts the device rows only.

    ``clock`` is the batch's stage clock (:mod:`streamproc.stages`; None: not timed), its one
    mutable part: each stage's thread laps it in turn as the batch is handed on.
    """

    batch_id: int
    records: tuple[Record, ...]
    cut_at_s: float
    reason: str = field(default="size")
    expired: tuple[Record, ...] = ()
    clock: Laps | None = field(default=None, compare=False, repr=False)
    priority: Priority = field(init=False)

    def __post_init__(self) -> None:
        if not self.records and not self.expired:
            raise ValueError("a batch is never empty")
        object.__setattr__(
            self, "priority", min(r.priority for r in (self.records or self.expired))
        )

    def __len__(self) -> int:
        return len(self.records)
