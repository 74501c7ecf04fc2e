"""The share source's ledger of the poll in flight: which of its records are not done yet, how
each one ends (``ACCEPT`` or ``REJECT``), and which wait to be run alone.

**Suspects run alone.** A record the group delivers a third time (``SUSPECT_DELIVERIES`` of
:mod:`streamproc.share.source`; a second delivery follows any release, a scale-down's included) was
held twice by a member that failed to finish it: crashed, killed, or let its lock run out. One
record of such a poll may be a *poison* record that kills whichever member runs it, and every
record that shared its poll was delivered again with it. Run together once more, they would all
reach the delivery limit with the poison record and be dead-lettered with it, valid records
included. So each suspect runs in a batch of its own, after the poll's other records, and its
acknowledgement is committed before the next one runs: a crash then costs only the records not
tried yet. Their order alternates with the delivery count (ascending offsets at an even count,
descending at an odd one), so the records behind the poison record in one round run before it in
the next: after two rounds only the poison record is left, and valid records finish within two
deliveries more than their first as suspects (by the fourth), below ``kafka.share_max_deliveries``
(at least 5). The poison record reaches the limit alone and is dead-lettered
(``streamproc.share``).

Owned by the share source's thread; nothing here is shared.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Literal

from streamproc.records import Record, TopicPartition

Ending = Literal["accept", "reject"]
"""How a record of the poll ends once done: its result (or dead-letter record) is durable
(``accept``), or it was dead-lettered for its delivery count (``reject``)."""

_Key = tuple[TopicPartition, int]


class PollLedger:
    """The records of the poll in flight (one at a time: the client takes no poll while a
    record of the previous one is not acknowledged)."""

    def __init__(self) -> None:
        # (partition, offset) -> the generation its record runs under (None: waiting to run
        # alone, under a generation given when it starts)
        self._outstanding: dict[_Key, int | None] = {}
        self._rejected: set[_Key] = set()
        self._waiting: deque[Record] = deque()
        self.running: Record | None = None
        """The suspect running alone now, if one is."""

    def __len__(self) -> int:
        """Records of the poll not done yet."""
        return len(self._outstanding)

    def add(self, records: Iterable[Record]) -> None:
        """``records`` run now (in their lanes' rings)."""
        for record in records:
            self._outstanding[(record.tp, record.offset)] = record.generation

    def add_rejected(self, record: Record) -> None:
        """``record`` is dead-lettered for its delivery count: rejected once that is durable."""
        key = (record.tp, record.offset)
        self._outstanding[key] = record.generation
        self._rejected.add(key)

    def wait_alone(self, suspects: Sequence[tuple[Record, int]]) -> None:
        """Queue ``suspects`` (each with its delivery count) to run one at a time, ordered as
        the module docstring says."""
        ordered = sorted(
            suspects,
            key=lambda pair: (
                (pair[0].tp.topic, pair[0].tp.partition, pair[0].offset)
                if pair[1] % 2 == 0
                else (pair[0].tp.topic, pair[0].tp.partition, -pair[0].offset)
            ),
        )
        for record, _ in ordered:
            self._outstanding[(record.tp, record.offset)] = None
            self._waiting.append(record)

    def next_alone(self) -> Record | None:
        """The next suspect to run, once every other record of the poll is done and no suspect
        runs (the caller runs it under a fresh generation: :meth:`started`)."""
        if self.running is not None or not self._waiting:
            return None
        if len(self._outstanding) > len(self._waiting):
            return None  # the poll's other records first
        return self._waiting.popleft()

    def started(self, record: Record) -> None:
        """``record`` (a suspect, as rebuilt under its fresh generation) runs now, alone."""
        self._outstanding[(record.tp, record.offset)] = record.generation
        self.running = record

    def done(self, record: Record) -> Ending | None:
        """``record``'s output is durable: how it ends, or None when it is not outstanding
        under that generation (released before, of an earlier poll, or reported twice)."""
        key = (record.tp, record.offset)
        if self._outstanding.get(key, -1) != record.generation:
            return None
        return "reject" if self._drop(key) else "accept"

    def forget(self, record: Record) -> None:
        """``record`` (the suspect just started) is released to the group, not run: no longer
        outstanding, and the next suspect may start."""
        self._drop((record.tp, record.offset))

    def _drop(self, key: _Key) -> bool:
        """No longer outstanding (nor running); whether it was to be rejected."""
        self._outstanding.pop(key, None)
        if self.running is not None and key == (self.running.tp, self.running.offset):
            self.running = None
        rejected = key in self._rejected
        self._rejected.discard(key)
        return rejected

    def release_all(self) -> dict[TopicPartition, list[int]]:
        """Forget every outstanding record; returns them per partition, in offset order, to be
        released to the group."""
        released: dict[TopicPartition, list[int]] = {}
        for tp, offset in sorted(
            self._outstanding, key=lambda k: (k[0].topic, k[0].partition, k[1])
        ):
            released.setdefault(tp, []).append(offset)
        self._outstanding.clear()
        self._rejected.clear()
        self._waiting.clear()
        self.running = None
        return released
