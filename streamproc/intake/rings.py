"""Per-partition ring buffers with pause/resume watermarks.

Pure policy: no Kafka calls. :meth:`PartitionBuffers.push` and :meth:`PartitionBuffers.take`
return which partitions to pause or resume; the source thread acts on them. Not thread-safe on
its own: the lane (:class:`streamproc.intake.lane.Lane`) serialises calls under its lock.

Flow control, per partition (capacity ``C``, high watermark ``H``, low watermark ``L``)::

    fill >= H*C  -> pause   (the source keeps polling; messages already fetched still arrive)
    fill == C    -> overflow: the record is refused and the source seeks back to its offset
    fill <= L*C  -> resume  (only if we paused it)
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from streamproc.records import Record, TopicPartition


class RingBuffer:
    """A bounded FIFO of records in offset order over a preallocated slot array.

    Besides the FIFO it keeps, per priority class, the consume times of its records in order,
    so the earliest deadline in the ring is O(1) to find.

    Args:
        capacity: number of slots (messages).
    """

    __slots__ = ("_classes", "_head", "_size", "_slots", "bytes", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._slots: list[Record | None] = [None] * capacity
        self._head = 0
        self._size = 0
        self.bytes = 0
        self._classes: tuple[deque[float], ...] = (deque(), deque(), deque())

    def oldest_by_class(self) -> tuple[float | None, ...]:
        """Per priority class (high, normal, low), the oldest consume time, or None."""
        return tuple(times[0] if times else None for times in self._classes)

    def deadline(self, max_wait_s: tuple[float, ...]) -> float:
        """Earliest ``consumed_at_s + max_wait_s[priority]`` among the records (inf if empty)."""
        # Unrolled (three classes): called once per taken record, on the hot path.
        high, normal, low = self._classes
        best = high[0] + max_wait_s[0] if high else math.inf
        if normal:
            candidate = normal[0] + max_wait_s[1]
            if candidate < best:
                best = candidate
        if low:
            candidate = low[0] + max_wait_s[2]
            if candidate < best:
                best = candidate
        return best

    def __len__(self) -> int:
        return self._size

    @property
    def full(self) -> bool:
        return self._size == self.capacity

    def push(self, record: Record) -> bool:
        """Append ``record``; return False (and keep nothing) when full (:meth:`push_many`
        of one record)."""
        return self.push_many((record,)) == 1

    def push_many(self, records: Sequence[Record]) -> int:
        """Append ``records`` (one partition's, in offset order) while there is room; returns
        how many were kept: ``records[:n]`` (the rest are refused). Their consume times must
        not decrease in push order (one source thread stamps them from a monotonic clock): the
        cut of a one-class ring bisects them (:meth:`_pop_slice`)."""
        capacity, size = self.capacity, self._size
        n = min(capacity - size, len(records))
        if n <= 0:
            return 0
        kept = records if n == len(records) else records[:n]
        start = (self._head + size) % capacity
        end = start + n
        slots = self._slots
        if end <= capacity:
            slots[start:end] = kept
        else:  # wraps around the slot array
            split = capacity - start
            slots[start:] = kept[:split]
            slots[: end - capacity] = kept[split:]
        self._size = size + n
        classes = self._classes
        added = 0
        for record in kept:
            added += len(record.key or b"") + len(record.value or b"")
            classes[record.priority].append(record.consumed_at_s)
        self.bytes += added
        return n

    def pop_run(
        self,
        out: list[Record],
        count: int,
        bytes_left: float,
        max_wait_s: tuple[float, ...],
        until: tuple[float, int],
        index: int,
        now_s: float = -math.inf,
        expired: list[Record] | None = None,
        expired_room: int = 0,
    ) -> tuple[int, float, bool]:
        """Pop records onto ``out`` (the cut being built) in offset order while ``out`` holds
        fewer than ``count``, the popped key+value bytes stay within ``bytes_left`` (the cut's
        first record is always taken) and the ring's next deadline ``(deadline, index)``
        stays at or before ``until`` (the runner-up ring's).

        A record whose deadline (``Record.deadline_s``) is at or before ``now_s`` goes onto
        ``expired`` instead (required then), counting against neither ``count`` nor
        ``bytes_left``; once ``expired_room`` of them were popped the run stops as if full.

        Returns:
            The bytes of the records popped onto ``out``, the ring's earliest deadline after
            the last pop (inf: empty), and whether the byte limit (or the expired room)
            stopped it.
        """
        high, normal, low = classes = self._classes
        if expired is None and bool(high) + bool(normal) + bool(low) == 1:
            # no deadline to check and a ring of one class: pop a slice
            c = 0 if high else 1 if normal else 2
            return self._pop_slice(out, count, bytes_left, classes[c], max_wait_s[c], until, index)
        wait_high, wait_normal, wait_low = max_wait_s
        slots, capacity = self._slots, self.capacity
        head, size = self._head, self._size
        popped = 0  # onto out
        shed = 0  # bytes onto expired
        deadline = math.inf
        taken = len(out)
        room = expired_room - len(expired) if expired is not None else 0
        inf = math.inf
        while taken < count and size:
            record = slots[head]
            assert record is not None
            record_bytes = len(record.key or b"") + len(record.value or b"")
            late = record.deadline_s <= now_s
            if not late and taken and popped + record_bytes > bytes_left:
                self._head, self._size = head, size
                self.bytes -= popped + shed
                return popped, deadline, True
            slots[head] = None
            head += 1
            if head == capacity:
                head = 0
            size -= 1
            classes[record.priority].popleft()
            if late:
                assert expired is not None
                expired.append(record)
                shed += record_bytes
                room -= 1
            else:
                popped += record_bytes
                out.append(record)
                taken += 1
            # the ring's earliest deadline now (RingBuffer.deadline, unrolled)
            deadline = high[0] + wait_high if high else inf
            if normal:
                candidate = normal[0] + wait_normal
                if candidate < deadline:
                    deadline = candidate
            if low:
                candidate = low[0] + wait_low
                if candidate < deadline:
                    deadline = candidate
            if late and room <= 0:
                self._head, self._size = head, size
                self.bytes -= popped + shed
                return popped, deadline, True
            if (deadline, index) > until:
                break
        self._head, self._size = head, size
        self.bytes -= popped + shed
        return popped, deadline, False

    def _pop_slice(
        self,
        out: list[Record],
        count: int,
        bytes_left: float,
        times: deque[float],
        wait_s: float,
        until: tuple[float, int],
        index: int,
    ) -> tuple[int, float, bool]:
        """:meth:`pop_run` without deadlines, for a ring whose records are all of the class
        whose consume times are ``times`` (``wait_s`` its max wait): the same pops, taken as
        one slice of the slot array instead of a record at a time (the cut of a backlog)."""
        size = self._size
        taken = len(out)
        n = min(count - taken, size)
        if n <= 0:
            return 0, math.inf, False
        # The loop pops a record, then stops once the ring's new earliest deadline (its next
        # record's: one class) passes ``until``; ties go by ring index. Consume times are in
        # push order, never decreasing, so the first record past it is found by bisection.
        until_s, until_index = until
        find = bisect.bisect_left if index > until_index else bisect.bisect_right
        k = find(times, until_s, 1, n, key=lambda consumed_at_s: consumed_at_s + wait_s)
        slots, capacity, head = self._slots, self.capacity, self._head
        end = head + k
        run = cast(
            "list[Record]",
            slots[head:end] if end <= capacity else slots[head:] + slots[: end - capacity],
        )
        full = False
        if bytes_left >= self.bytes:  # the whole ring fits: no record can pass the limit
            # Record.size_bytes inlined: a property call per record costs more on this path
            popped = (
                self.bytes
                if k == size
                else sum([len(r.key or b"") + len(r.value or b"") for r in run])
            )
        else:
            popped = kept = 0
            for record in run:  # the byte limit falls inside the ring: rare, not inlined
                record_bytes = record.size_bytes
                if (taken or kept) and popped + record_bytes > bytes_left:
                    full = True
                    break
                popped += record_bytes
                kept += 1
            if full:
                if not kept:
                    return 0, math.inf, True
                k, end = kept, head + kept
                del run[kept:]
        if end <= capacity:
            slots[head:end] = [None] * k
        else:
            slots[head:] = [None] * (capacity - head)
            slots[: end - capacity] = [None] * (end - capacity)
        self._head = end % capacity
        self._size = size - k
        self.bytes -= popped
        out.extend(run)
        if k == len(times):
            times.clear()
        else:
            popleft = times.popleft
            for _ in itertools.repeat(None, k):
                popleft()
        return popped, times[0] + wait_s if times else math.inf, full

    def peek(self) -> Record | None:
        """The oldest record, or None when empty."""
        return self._slots[self._head] if self._size else None

    def pop(self) -> Record:
        """Remove and return the oldest record.

        Raises:
            IndexError: the ring is empty.
        """
        if not self._size:
            raise IndexError("pop from an empty ring")
        record = self._slots[self._head]
        assert record is not None
        self._slots[self._head] = None
        self._head = (self._head + 1) % self.capacity
        self._size -= 1
        self.bytes -= record.size_bytes
        self._classes[record.priority].popleft()
        return record

    def clear(self) -> list[Record]:
        """Remove and return every record, oldest first (two slices of the slot array at most,
        not a pop per record: a full ring of the default 16,384 records is cleared under the
        lane's lock at every revoke and rewind)."""
        head, size, capacity, slots = self._head, self._size, self.capacity, self._slots
        end = head + size
        if end <= capacity:
            records = slots[head:end]
            slots[head:end] = [None] * size
        else:
            wrapped = end - capacity
            records = slots[head:] + slots[:wrapped]
            slots[head:] = [None] * (capacity - head)
            slots[:wrapped] = [None] * wrapped
        self._head = 0
        self._size = 0
        self.bytes = 0
        for times in self._classes:
            times.clear()
        return cast(list[Record], records)


def high_mark(capacity: int, high_watermark: float) -> int:
    """The records at which a ring of ``capacity`` pauses its partition: ``high_watermark`` x
    ``capacity``, rounded, within 1..``capacity`` (the source sizes librdkafka's prefetch by
    the same number)."""
    return max(1, min(capacity, round(high_watermark * capacity)))


@dataclass(frozen=True, slots=True)
class FlowControl:
    """Partitions the source must pause or resume; either may be empty."""

    pause: tuple[TopicPartition, ...] = ()
    resume: tuple[TopicPartition, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.pause or self.resume)


NO_CHANGE = FlowControl()


@dataclass(frozen=True, slots=True)
class RingView:
    """What the batcher sees of one non-empty ring."""

    tp: TopicPartition
    size: int
    bytes: int
    oldest_by_class: tuple[float | None, ...]

    def deadline_s(self, max_wait_s: tuple[float, ...]) -> float:
        """Earliest deadline in the ring given per-class max waits (seconds)."""
        return min(
            (t + w for t, w in zip(self.oldest_by_class, max_wait_s, strict=True) if t is not None),
            default=math.inf,
        )


class PartitionBuffers:
    """One :class:`RingBuffer` per assigned partition plus our own pause bookkeeping.

    A ring's fill is the larger of its two fractions: records of ``capacity`` and bytes
    (:attr:`Record.size_bytes`) of ``capacity_bytes``. A partition pauses when either reaches
    the high watermark and resumes once both are at or below the low one, so rings of many light
    messages and rings of a few large ones (video frames) both stay within their memory. The
    bytes are a pause threshold, not a hard limit: the records of the poll that crossed it
    still land (``capacity`` records is the hard limit).

    Args:
        capacity: ring capacity in messages.
        high_watermark: pause when fill >= this fraction of capacity.
        low_watermark: resume a paused partition when fill <= this fraction of capacity.
        capacity_bytes: ring capacity in bytes (None: records only).
    """

    def __init__(
        self,
        capacity: int,
        high_watermark: float,
        low_watermark: float,
        capacity_bytes: int | None = None,
    ) -> None:
        self.capacity = capacity
        self.high = high_mark(capacity, high_watermark)
        self.low = min(self.high - 1, int(low_watermark * capacity))
        self.capacity_bytes = math.inf if capacity_bytes is None else capacity_bytes
        self.high_bytes = high_watermark * self.capacity_bytes
        self.low_bytes = low_watermark * self.capacity_bytes
        self._rings: dict[TopicPartition, RingBuffer] = {}
        self._paused: set[TopicPartition] = set()

    # -- assignment ------------------------------------------------------------------------
    def assign(self, tps: Iterable[TopicPartition]) -> FlowControl:
        """Give each partition a fresh, empty ring; resume it (never trust the client's state)."""
        fresh = tuple(tps)
        for tp in fresh:
            self._rings[tp] = RingBuffer(self.capacity)
            self._paused.discard(tp)
        return FlowControl(resume=fresh)

    def revoke(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, list[Record]]:
        """Drop the rings of ``tps``; return the records that were still waiting in them."""
        dropped: dict[TopicPartition, list[Record]] = {}
        for tp in tps:
            ring = self._rings.pop(tp, None)
            self._paused.discard(tp)
            if ring is not None:
                dropped[tp] = ring.clear()
        return dropped

    @property
    def assigned(self) -> frozenset[TopicPartition]:
        return frozenset(self._rings)

    @property
    def paused(self) -> frozenset[TopicPartition]:
        return frozenset(self._paused)

    # -- data path -------------------------------------------------------------------------
    def push(self, record: Record) -> FlowControl | None:
        """Append a consumed record to its partition's ring.

        Returns:
            None when the record was refused (ring full or partition not assigned): the caller
            must not track it and must seek the partition back to ``record.offset``. Otherwise
            the flow-control change (pause at the high watermark), possibly :data:`NO_CHANGE`.
        """
        kept, pause = self.push_run(record.tp, (record,))
        if not kept:
            return None
        return FlowControl(pause=(record.tp,)) if pause else NO_CHANGE

    def push_run(self, tp: TopicPartition, records: Sequence[Record]) -> tuple[int, bool]:
        """Append one partition's consumed records (in offset order) to its ring.

        Returns:
            How many were kept (``records[:n]``; the rest are refused: the caller must not
            track them and must seek the partition back to the first refused offset; none are
            kept when ``tp`` is not assigned), and whether ``tp`` is to be paused now (it
            reached the high watermark in this call).
        """
        ring = self._rings.get(tp)
        if ring is None:
            return 0, False
        kept = ring.push_many(records)
        paused = self._paused
        pause = (len(ring) >= self.high or ring.bytes >= self.high_bytes) and tp not in paused
        if pause or kept < len(records):
            paused.add(tp)
        return kept, pause

    def views(self) -> list[RingView]:
        """Non-empty rings, for the batcher."""
        return [
            RingView(tp, len(ring), ring.bytes, ring.oldest_by_class())
            for tp, ring in self._rings.items()
            if len(ring)
        ]

    def take(
        self,
        count: int,
        max_bytes: int | None = None,
        max_wait_s: tuple[float, ...] = (0.0, 0.0, 0.0),
    ) -> tuple[list[Record], FlowControl]:
        """Remove up to ``count`` records, earliest deadline first across partitions.

        Deadlines use ``max_wait_s`` per priority class (the batcher's); with equal waits this
        is oldest consume time first. Within a partition records leave in offset order (a
        partition whose ring holds an
        urgent record behind older ones is served first, head first). ``max_bytes`` stops the
        cut before the record that would exceed it (the first record is always taken).

        Returns:
            The records and the partitions to resume (paused ones now at or below the low
            watermark).
        """
        taken: list[Record] = []
        return taken, self._take(taken, count, max_bytes, max_wait_s, -math.inf, None, 0)

    def take_live(
        self,
        count: int,
        max_bytes: int | None,
        max_wait_s: tuple[float, ...],
        now_s: float,
        max_expired: int,
    ) -> tuple[list[Record], list[Record], FlowControl]:
        """:meth:`take`, where a record past its deadline at ``now_s`` (``Record.deadline_s``,
        monotonic seconds) is set apart and takes no live record's place: up to ``count``
        live records within ``max_bytes``, in the same order as :meth:`take` pops them, and
        the expired ones met on the way until ``max_expired`` (>= 1) of them.

        Returns:
            The live records, the expired ones (each in the order popped) and the partitions
            to resume.
        """
        taken: list[Record] = []
        expired: list[Record] = []
        flow = self._take(taken, count, max_bytes, max_wait_s, now_s, expired, max_expired)
        return taken, expired, flow

    def _take(
        self,
        taken: list[Record],
        count: int,
        max_bytes: int | None,
        wait: tuple[float, ...],
        now_s: float,
        expired: list[Record] | None,
        max_expired: int,
    ) -> FlowControl:
        rings = self._rings
        heap = [
            (ring.deadline(wait), index, tp)
            for index, (tp, ring) in enumerate(rings.items())
            if len(ring)
        ]
        heapq.heapify(heap)
        bytes_left = math.inf if max_bytes is None else float(max_bytes)
        touched: set[TopicPartition] = set()
        while heap and len(taken) < count:
            _, index, tp = heap[0]
            ring = rings[tp]
            touched.add(tp)
            # Serve this ring while it stays the earliest: until its next deadline passes the
            # runner-up's (a run of pops per heap operation, not one heap operation per record).
            # (deadline, index) of the runner-up: the smaller child of the heap's root.
            runner_up = min(heap[1:3])[:2] if len(heap) > 1 else (math.inf, 0)
            popped, deadline, full = ring.pop_run(
                taken, count, bytes_left, wait, runner_up, index, now_s, expired, max_expired
            )
            if full:
                return self._resumable(touched)
            bytes_left -= popped
            if not len(ring):
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (deadline, index, tp))
        return self._resumable(touched)

    def _resumable(self, touched: set[TopicPartition]) -> FlowControl:
        rings, low, low_bytes = self._rings, self.low, self.low_bytes
        resume = tuple(
            tp
            for tp in touched
            if tp in self._paused and len(rings[tp]) <= low and rings[tp].bytes <= low_bytes
        )
        self._paused.difference_update(resume)
        return FlowControl(resume=resume) if resume else NO_CHANGE

    def fill_ratios(self) -> dict[TopicPartition, float]:
        """Fill of each ring as a fraction of capacity: the larger of its records' and its
        bytes' fraction (without ``capacity_bytes``, the bytes' is 0)."""
        capacity, capacity_bytes = self.capacity, self.capacity_bytes
        return {
            tp: max(len(ring) / capacity, ring.bytes / capacity_bytes)
            for tp, ring in self._rings.items()
        }

    def total(self) -> int:
        """Messages waiting across all rings."""
        return sum(len(ring) for ring in self._rings.values())
