"""Offset tracking per assignment: contiguous watermarks, never past a gap.

An input offset is *done* when its result (or its dead-letter record) was acknowledged by the
broker. Per partition the committable offset is the first not-done offset among those consumed,
or, when all are done, the offset after the last one the consumer passed: the last consumed
offset + 1, or further where the consumer's position moved past offsets that hold no message
(:meth:`OffsetTracker.passed`: the transaction marker after a transactional producer's records,
aborted or compacted records). Committing that far is what lets the lag of a drained partition
read 0: a commit at the marker's offset would leave a lag of 1 for ever.

Each assignment of a partition gets a new :class:`PartitionTrack` with a higher ``generation``;
a completion carrying an older generation (a late result for a partition we no longer own, or
owned again since) is counted in :attr:`OffsetTracker.late_results`, reported to the
``on_late`` hook as it happens (the assembly's hook moves ``streamproc_late_results_total`` and logs
one line per revoked partition), and ignored. Thread-safe.

The committers (:mod:`streamproc.offsets.committers`) turn the watermarks into commits.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import attrgetter

from streamproc.records import Record, TopicPartition
from streamproc.stages import CommitWait

_TP_GENERATION = attrgetter("tp", "generation")


def _runs(records: Iterable[Record]) -> Iterator[tuple[TopicPartition, int, list[int]]]:
    """``records`` as runs of consecutive records of one partition and generation (a batch
    takes each partition's records in runs, so a few per batch): ``(tp, generation, offsets)``."""
    for (tp, generation), run in itertools.groupby(records, _TP_GENERATION):
        yield tp, generation, [record.offset for record in run]


class PartitionTrack:
    """Consumed and done offsets of one partition within one assignment.

    Contract checks: consumed offsets strictly increase; a done offset must have been consumed.
    """

    __slots__ = (
        "_done",
        "_pending",
        "_stamps",
        "acked",
        "committed",
        "generation",
        "last_consumed",
    )

    def __init__(self, generation: int) -> None:
        self.generation = generation
        # acknowledged runs not yet covered by a commit: (last offset, records, monotonic s)
        self.acked: deque[tuple[int, int, float]] = deque()
        self._pending: deque[int] = deque()
        self._stamps: deque[int] = deque()  # per pending offset, its record's timestamp (ms)
        self._done: set[int] = set()
        self.last_consumed: int | None = None
        self.committed: int | None = None

    def consumed(self, offset: int, timestamp_ms: int = 0) -> None:
        if self.last_consumed is not None and offset <= self.last_consumed:
            raise ValueError(f"offset {offset} consumed after {self.last_consumed}")
        self.last_consumed = offset
        self._pending.append(offset)
        self._stamps.append(timestamp_ms)

    def consumed_run(self, records: Sequence[Record]) -> None:
        """:meth:`consumed` for each of ``records`` (this partition's, in offset order), in
        one pass: the order is checked, then the offsets appended at once."""
        offsets = [record.offset for record in records]
        last = self.last_consumed
        if last is not None and offsets[0] <= last:
            raise ValueError(f"offset {offsets[0]} consumed after {last}")
        for earlier, later in itertools.pairwise(offsets):
            if later <= earlier:
                raise ValueError(f"offset {later} consumed after {earlier}")
        self.last_consumed = offsets[-1]
        self._pending.extend(offsets)
        self._stamps.extend([record.timestamp_ms for record in records])

    def passed(self, position: int) -> None:
        """The consumer's position is ``position``: every offset below it was consumed or
        holds no message."""
        if self.last_consumed is None or position - 1 > self.last_consumed:
            self.last_consumed = position - 1

    def done(self, offset: int) -> None:
        if offset in self._done or not self._pending or offset < self._pending[0]:
            return  # already done (duplicate acknowledgement) or below the watermark
        self._done.add(offset)
        pending, stamps, done = self._pending, self._stamps, self._done
        while pending and pending[0] in done:
            done.discard(pending.popleft())
            stamps.popleft()

    def done_run(self, offsets: list[int]) -> None:
        """:meth:`done` for each of ``offsets`` in order. The common case, the oldest pending
        offsets exactly (a batch's run of this partition, acknowledged in offset order with
        nothing done early), is popped at once."""
        pending = self._pending
        count = len(offsets)
        if (
            not self._done
            and len(pending) >= count
            and list(itertools.islice(pending, count)) == offsets
        ):
            if count == len(pending):
                pending.clear()
                self._stamps.clear()
                return
            popleft, stamps_popleft = pending.popleft, self._stamps.popleft
            for _ in itertools.repeat(None, count):
                popleft()
                stamps_popleft()
            return
        for offset in offsets:
            self.done(offset)

    @property
    def oldest_ms(self) -> int | None:
        """Timestamp (ms since the epoch) of the oldest consumed offset not yet done."""
        return self._stamps[0] if self._stamps else None

    @property
    def watermark(self) -> int | None:
        """The offset to commit: first not-done consumed offset, or last consumed + 1."""
        if self._pending:
            return self._pending[0]
        return None if self.last_consumed is None else self.last_consumed + 1

    @property
    def pending(self) -> int:
        """Consumed offsets not yet done."""
        return len(self._pending) - len(self._done)


LateHook = Callable[[TopicPartition, int, bool], None]
"""``(partition, late results, first for this assignment)``, called outside the lock."""


class OffsetTracker:
    """Per-partition tracks for the current assignment.

    Besides the offsets it keeps, per partition, when acknowledged runs of records were
    acknowledged (:meth:`done_many`, :meth:`acked`) until a commit covers them
    (:meth:`mark_committed` returns their waits: the ``commit`` stage of
    :mod:`streamproc.stages`).

    Args:
        on_late: called as late results happen (see :data:`LateHook`), from the thread that
            reported them (a delivery report or the completion thread), never under the lock.
        clock: monotonic seconds (acknowledgement and commit times; injected for tests).
    """

    def __init__(
        self, on_late: LateHook | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._tracks: dict[TopicPartition, PartitionTrack] = {}
        self._next_generation = 1
        self._on_late = on_late
        # per partition, the last generation whose late results were reported as "first"
        self._late_reported: dict[TopicPartition, int] = {}
        self.late_results = 0

    def assign(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Start a fresh track for each partition; return their generations."""
        with self._lock:
            out = {}
            for tp in tps:
                self._tracks[tp] = PartitionTrack(self._next_generation)
                out[tp] = self._next_generation
                self._next_generation += 1
            return out

    def generation(self, tp: TopicPartition) -> int | None:
        with self._lock:
            track = self._tracks.get(tp)
            return None if track is None else track.generation

    def is_current(self, tp: TopicPartition, generation: int) -> bool:
        """True when ``tp`` is assigned under ``generation`` (not revoked, not rewound)."""
        with self._lock:
            track = self._tracks.get(tp)
            return track is not None and track.generation == generation

    def consumed(self, tp: TopicPartition, offset: int, timestamp_ms: int = 0) -> None:
        """Record that ``offset`` of ``tp`` (its record's timestamp ``timestamp_ms``, ms since
        the epoch) entered the pipeline."""
        with self._lock:
            self._tracks[tp].consumed(offset, timestamp_ms)

    def consumed_many(self, records: Iterable[Record]) -> None:
        """:meth:`consumed` for each record, under one lock acquisition."""
        with self._lock:
            tracks = self._tracks
            for record in records:
                tracks[record.tp].consumed(record.offset, record.timestamp_ms)

    def consumed_runs(self, runs: Mapping[TopicPartition, Sequence[Record]]) -> None:
        """:meth:`consumed` for each record of ``runs`` (per partition, a non-empty list of its
        records in offset order), under one lock acquisition and one pass per partition."""
        with self._lock:
            tracks = self._tracks
            for tp, records in runs.items():
                tracks[tp].consumed_run(records)

    def passed(self, positions: dict[TopicPartition, tuple[int, int]]) -> None:
        """Per partition, ``(generation, position)``: the consumer's position moved to
        ``position`` and every offset below it that held a message was consumed (the caller,
        the consumer's thread, checks that); the rest held none (markers, aborted or compacted
        records). Moves the watermark of a drained partition to ``position``. A partition
        under another generation is left alone."""
        with self._lock:
            for tp, (generation, position) in positions.items():
                track = self._tracks.get(tp)
                if track is not None and track.generation == generation:
                    track.passed(position)

    def backlog(self) -> dict[TopicPartition, tuple[int, int | None]]:
        """Per assigned partition: consumed offsets not yet done, and the timestamp (ms since
        the epoch) of the oldest of them (None when none)."""
        with self._lock:
            return {tp: (t.pending, t.oldest_ms) for tp, t in self._tracks.items()}

    def done_many(self, records: Iterable[Record]) -> int:
        """:meth:`done` for each record (its own partition and generation), under one lock
        acquisition, their acknowledgement noted for the commit stage (:meth:`acked`);
        returns how many were current (the rest are counted as late)."""
        current = 0
        late: dict[tuple[TopicPartition, int], int] | None = None
        with self._cond:
            now_s = self._clock()
            tracks = self._tracks
            # one lookup and one acknowledged run noted per run, not per record
            for tp, generation, offsets in _runs(records):
                track = tracks.get(tp)
                if track is None or track.generation != generation:
                    if late is None:
                        late = {}
                    late[tp, generation] = late.get((tp, generation), 0) + len(offsets)
                    continue
                track.done_run(offsets)
                current += len(offsets)
                track.acked.append((max(offsets), len(offsets), now_s))
            self._cond.notify_all()
        if late:
            for (tp, generation), count in late.items():
                self.late(tp, generation, count)
        return current

    def acked(self, records: Iterable[Record]) -> None:
        """The results of ``records`` were acknowledged now (inputs done before, as
        exactly-once marks them when they join the transaction): noted per partition for the
        commit stage, like :meth:`done_many` does; records of a generation no longer current
        are left out."""
        with self._lock:
            now_s = self._clock()
            tracks = self._tracks
            for tp, generation, offsets in _runs(records):
                track = tracks.get(tp)
                if track is not None and track.generation == generation:
                    track.acked.append((max(offsets), len(offsets), now_s))

    def done(self, tp: TopicPartition, offset: int, generation: int) -> bool:
        """Mark ``offset`` done; False (and counted) when ``generation`` is not current."""
        with self._cond:
            track = self._tracks.get(tp)
            if track is not None and track.generation == generation:
                track.done(offset)
                self._cond.notify_all()
                return True
        self.late(tp, generation)
        return False

    def late(self, tp: TopicPartition, generation: int, count: int = 1) -> None:
        """Count ``count`` results of ``tp`` under a generation that is no longer current."""
        with self._lock:
            self.late_results += count
            first = self._late_reported.get(tp, 0) < generation
            if first:
                self._late_reported[tp] = generation
        if self._on_late is not None:
            self._on_late(tp, count, first)

    def commit_candidates(self) -> dict[TopicPartition, int]:
        """Watermarks that moved past the last committed offset, per partition."""
        with self._lock:
            return {
                tp: wm
                for tp, track in self._tracks.items()
                if (wm := track.watermark) is not None and wm != track.committed
            }

    def watermarks(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Current watermarks of ``tps`` that consumed anything."""
        with self._lock:
            return {
                tp: wm
                for tp in tps
                if (track := self._tracks.get(tp)) is not None
                and (wm := track.watermark) is not None
            }

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> list[CommitWait]:
        """Remember offsets sent for commit (same assignment only); see :meth:`forget_committed`.

        Returns:
            The acknowledged runs the commit covers (every offset of the run below the
            committed one), each with its wait from acknowledgement to now; they are
            forgotten (a commit that then fails does not bring them back).
        """
        waits: list[CommitWait] = []
        with self._lock:
            now_s = self._clock()
            for tp, offset in offsets.items():
                track = self._tracks.get(tp)
                if track is None:
                    continue
                track.committed = offset
                acked = track.acked
                if not acked:
                    continue
                if acked[-1][0] < offset:  # the usual case: the commit covers every run
                    waits.extend((tp.topic, now_s - at_s, count) for _, count, at_s in acked)
                    acked.clear()
                    continue
                kept: deque[tuple[int, int, float]] = deque()
                for run in acked:  # runs may be acknowledged out of offset order
                    if run[0] < offset:
                        waits.append((tp.topic, now_s - run[2], run[1]))
                    else:
                        kept.append(run)
                track.acked = kept
        return waits

    def forget_committed(self, offsets: dict[TopicPartition, int]) -> None:
        """Undo :meth:`mark_committed` for a commit that failed, so it is retried."""
        with self._lock:
            for tp, offset in offsets.items():
                track = self._tracks.get(tp)
                if track is not None and track.committed == offset:
                    track.committed = None

    def pending(self, tp: TopicPartition) -> int:
        with self._lock:
            track = self._tracks.get(tp)
            return 0 if track is None else track.pending

    def total_pending(self) -> int:
        with self._lock:
            return sum(t.pending for t in self._tracks.values())

    def wait_until(self, tp_limits: dict[TopicPartition, int], timeout_s: float) -> bool:
        """Wait until each ``tp``'s pending count is <= its limit; False on timeout."""

        def settled() -> bool:
            return all(
                (t := self._tracks.get(tp)) is None or t.pending <= limit
                for tp, limit in tp_limits.items()
            )

        with self._cond:
            return self._cond.wait_for(settled, timeout=timeout_s)

    def retire(self) -> None:
        """End every partition's current generation, keeping its offsets (an aborted
        transaction: no result of the aborted work may join the next transaction, and until
        the rewind starts fresh tracks the pipeline must not look idle)."""
        with self._cond:
            for track in self._tracks.values():
                track.generation = self._next_generation
                self._next_generation += 1
            self._cond.notify_all()

    def revoke(self, tps: Iterable[TopicPartition]) -> None:
        """Forget ``tps``; later completions for them count as late results."""
        with self._cond:
            for tp in tps:
                self._tracks.pop(tp, None)
            self._cond.notify_all()
