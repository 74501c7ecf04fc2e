"""Records the broker refused for their own reason, remembered across an aborted transaction.

Under exactly-once, one refused record dooms its whole transaction (the transactional producer
turns any failed delivery into an abortable error): the transaction aborts, the partitions
rewind to their committed offsets, and the same inputs come back. Without a memory the same
record is refused again, forever. :class:`Refusals` is that memory, keyed by the input's
coordinates (partition, offset):

* a result refused in a record batch it may have shared (``MSG_SIZE_TOO_LARGE`` and
  ``INVALID_RECORD`` judge a whole record batch) is a *suspect*: when its input comes back, its
  result is produced in a record batch of its own, so a second refusal names it alone;
* a result refused in a record batch of its own is *at fault*: when its input comes back, it is
  dead-lettered (stage ``produce``, the broker's reason in the headers) inside the transaction,
  and its offset commits with the rest;
* a dead-letter record refused as too large is sent again without its value.

Only record-level errors (:data:`RECORD_REFUSALS`) are remembered; anything else (a timeout, a
purge by the abort, the producer's erroneous state after the first failure) is collateral and
simply retried after the rewind. :meth:`Refusals.learned` tells the committer whether an abort
taught anything new, so repeated aborts that teach nothing are bounded
(``kafka.max_transaction_aborts``).

Thread ownership: the exactly-once guarantee owns its :class:`Refusals`. Delivery reports
(whichever thread polls the producer) call :meth:`Refusals.refused`; the results thread calls
:meth:`Refusals.get`; the source thread calls :meth:`Refusals.learned`,
:meth:`Refusals.committed` and :meth:`Refusals.forget` (rebalances). One private lock, a leaf:
nothing else is taken while it is held, and nothing calls out under it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from confluent_kafka import KafkaError

from streamproc.records import Record, TopicPartition

RECORD_REFUSALS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,  # over the topic's max.message.bytes (or the producer's)
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_RECORD,  # e.g. no key on a compacted topic
        KafkaError.POLICY_VIOLATION,
        KafkaError.INVALID_TIMESTAMP,  # outside the topic's message.timestamp.*.max.ms
    }
)
"""Broker errors that judge a record (or the record batch holding it), not the cluster or the
producer: the same record is refused again however often it is retried."""


def record_refusal(err: KafkaError) -> bool:
    """True when ``err`` refuses a record for its own sake (see :data:`RECORD_REFUSALS`)."""
    return err.code() in RECORD_REFUSALS


@dataclass(frozen=True)
class Refusal:
    """Why the broker refused an input's output.

    Attributes:
        error: the error's name (``MSG_SIZE_TOO_LARGE``), written as ``KafkaError.<name>``.
        message: the broker's reason.
        alone: the refused record was alone in its record batch: it is at fault, and its input
            is dead-lettered when it comes back (else it is produced alone next time).
        omit_value: the input's dead-letter record was refused as too large: the next one
            leaves the value out.
    """

    error: str
    message: str
    alone: bool
    omit_value: bool = False


class Refusals:
    """The memory of refused records, per partition and offset (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_partition: dict[TopicPartition, dict[int, Refusal]] = {}
        self._count = 0  # refusals held; read without the lock (one int: atomic under the GIL)
        self._learned: str | None = None  # the error of the first refusal learned lately

    def __len__(self) -> int:
        """How many refusals are remembered (the hot path's cheap "anything at all?")."""
        return self._count

    def refused(self, record: Record, err: KafkaError, alone: bool, dead_letter: bool) -> bool:
        """The broker refused the output of ``record`` with ``err``: remember it if ``err`` is
        a record-level refusal (returns True), else ignore it (collateral: returns False).

        Args:
            alone: the refused record was alone in its record batch.
            dead_letter: the refused record was the input's dead-letter record.
        """
        if not record_refusal(err):
            return False
        with self._lock:
            known = self._by_partition.setdefault(record.tp, {})
            before = known.get(record.offset)
            if dead_letter:
                base = before or Refusal(err.name(), err.str(), alone=True)
                after = replace(base, omit_value=True)
            elif before is None:
                after = Refusal(err.name(), err.str(), alone)
            else:  # at fault stays at fault; a dead-letter record's refusal is kept
                after = replace(
                    before, error=err.name(), message=err.str(), alone=alone or before.alone
                )
            if after != before:
                known[record.offset] = after
                self._count += before is None
                if self._learned is None:
                    self._learned = err.name()
        return True

    def get(self, record: Record) -> Refusal | None:
        """What is known of ``record``'s earlier refusal, if anything."""
        with self._lock:
            known = self._by_partition.get(record.tp)
            return None if known is None else known.get(record.offset)

    def known(self, records: Sequence[Record]) -> dict[int, Refusal]:
        """Per row of ``records`` (a batch), its earlier refusal, for the rows that have one."""
        with self._lock:
            by_partition = self._by_partition
            found: dict[int, Refusal] = {}
            for row, record in enumerate(records):
                known = by_partition.get(record.tp)
                refusal = None if known is None else known.get(record.offset)
                if refusal is not None:
                    found[row] = refusal
            return found

    def learned(self) -> str | None:
        """The error's name of the first refusal learned (or sharpened) since the last call, or
        None: an abort that taught something is progress, and that error is why it aborted."""
        with self._lock:
            learned, self._learned = self._learned, None
            return learned

    def described(self, limit: int = 10) -> str:
        """The remembered refusals as ``topic[partition]@offset (ERROR)``, at most ``limit``."""
        with self._lock:
            items = [
                f"{tp.topic}[{tp.partition}]@{offset} ({refusal.error})"
                for tp, known in sorted(self._by_partition.items())
                for offset, refusal in sorted(known.items())
            ]
        more = f" and {len(items) - limit} more" if len(items) > limit else ""
        return ", ".join(items[:limit]) + more if items else "none"

    def committed(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Offsets below each committed watermark are settled: forget them."""
        with self._lock:
            for tp, watermark in offsets.items():
                known = self._by_partition.get(tp)
                if known:
                    for offset in [o for o in known if o < watermark]:
                        del known[offset]
                        self._count -= 1

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """``tps`` are no longer ours (revoke, lost): their next owner learns for itself."""
        with self._lock:
            for tp in tps:
                self._count -= len(self._by_partition.pop(tp, {}))
