from __future__ import annotations

import math
import random

import pytest

from streamproc.intake.rings import NO_CHANGE, PartitionBuffers, RingBuffer
from streamproc.records import Record, TopicPartition

A = TopicPartition("t", 0)
B = TopicPartition("t", 1)


def rec(tp: TopicPartition, offset: int, at_s: float = 0.0, size: int = 10) -> Record:
    return Record(tp, offset, None, b"x" * size, (), 0, at_s, 1)


def test_ring_is_fifo_and_bounded() -> None:
    ring = RingBuffer(3)
    assert all(ring.push(rec(A, i)) for i in range(3))
    assert ring.full
    assert not ring.push(rec(A, 3))
    assert [ring.pop().offset for _ in range(2)] == [0, 1]
    assert ring.push(rec(A, 3))  # wraps around the slot array
    assert [r.offset for r in ring.clear()] == [2, 3]
    assert len(ring) == 0 and ring.bytes == 0
    with pytest.raises(IndexError):
        ring.pop()


@pytest.mark.parametrize("seed", range(30))
def test_clear_returns_what_pops_would_and_leaves_an_empty_ring_that_works(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.randint(1, 12)
    ring, model = RingBuffer(capacity), RingBuffer(capacity)
    offset = 0
    for _ in range(rng.randint(0, 40)):  # pushes and pops until the head has wrapped
        if rng.random() < 0.6 and len(ring) < capacity:
            record = Record(
                A, offset, None, b"x" * rng.randint(0, 9), (), 0, 0.0, 1, rng.choice([0, 1, 2])
            )
            ring.push(record)
            model.push(record)
            offset += 1
        elif len(ring):
            assert ring.pop() is model.pop()
    expected = [model.pop() for _ in range(len(model))]
    assert ring.clear() == expected
    assert len(ring) == 0 and ring.bytes == 0
    assert ring.oldest_by_class() == (None, None, None)
    assert ring._slots == [None] * capacity  # no record stays referenced
    again = rec(A, offset, size=3)
    ring.push(again)
    assert ring.pop() is again and ring.bytes == 0


def test_pause_at_high_and_resume_at_low_watermark() -> None:
    bufs = PartitionBuffers(capacity=8, high_watermark=0.5, low_watermark=0.25)
    assert bufs.assign([A]).resume == (A,)
    flows = [bufs.push(rec(A, i)) for i in range(4)]
    assert flows[:3] == [NO_CHANGE] * 3
    assert flows[3] is not None and flows[3].pause == (A,)
    assert bufs.push(rec(A, 4)) == NO_CHANGE  # already paused: no second decision
    _, flow = bufs.take(2)
    assert flow == NO_CHANGE  # 3 left, above the low watermark (2)
    _, flow = bufs.take(1)
    assert flow.resume == (A,)
    assert A not in bufs.paused


def test_a_ring_of_large_records_pauses_by_bytes_and_resumes_once_both_are_low() -> None:
    # 1,000 records of room but 100 bytes: a few large records fill it (video frames), while
    # light ones still pause by count
    bufs = PartitionBuffers(
        capacity=1000, high_watermark=0.5, low_watermark=0.25, capacity_bytes=100
    )
    bufs.assign([A, B])
    flows = [bufs.push(rec(A, i, size=20)) for i in range(3)]
    assert flows[:2] == [NO_CHANGE] * 2
    assert flows[2] is not None and flows[2].pause == (A,)  # 60 bytes >= 50
    assert bufs.fill_ratios()[A] == pytest.approx(0.6)  # bytes: 60 / 100, records 3 / 1000
    _, flow = bufs.take(1)
    assert flow == NO_CHANGE  # 40 bytes left: above the low watermark (25)
    _, flow = bufs.take(1)
    assert flow.resume == (A,)  # 20 bytes
    # a light partition: the bytes stay low, the records pause it at 500
    kept, pause = bufs.push_run(B, [rec(B, i, size=0) for i in range(500)])
    assert kept == 500 and pause and bufs.fill_ratios()[B] == pytest.approx(0.5)
    # resumed only once the records are low too (a ring paused by count, bytes always low)
    taken, flow = bufs.take(200)
    assert len(taken) == 200 and flow == NO_CHANGE  # B holds 300 or 301: above 250
    _, flow = bufs.take(51)
    assert flow.resume == (B,)


def test_full_ring_refuses_record_for_seek_back() -> None:
    bufs = PartitionBuffers(capacity=2, high_watermark=1.0, low_watermark=0.0)
    bufs.assign([A])
    assert bufs.push(rec(A, 0)) == NO_CHANGE
    assert bufs.push(rec(A, 1)).pause == (A,)
    assert bufs.push(rec(A, 2)) is None  # refused: caller seeks back to offset 2
    assert bufs.push(rec(B, 0)) is None  # not assigned


def test_take_is_oldest_first_across_partitions_and_in_offset_order() -> None:
    bufs = PartitionBuffers(capacity=8, high_watermark=1.0, low_watermark=0.0)
    bufs.assign([A, B])
    for offset, at_s in enumerate([1.0, 3.0, 5.0]):
        bufs.push(rec(A, offset, at_s))
    for offset, at_s in enumerate([2.0, 4.0]):
        bufs.push(rec(B, offset, at_s))
    taken, _ = bufs.take(4)
    assert [(r.tp.partition, r.offset) for r in taken] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert bufs.total() == 1


def test_take_respects_max_bytes_but_always_takes_one() -> None:
    bufs = PartitionBuffers(capacity=8, high_watermark=1.0, low_watermark=0.0)
    bufs.assign([A])
    for i in range(4):
        bufs.push(rec(A, i, size=100))
    taken, _ = bufs.take(4, max_bytes=250)
    assert len(taken) == 2
    taken, _ = bufs.take(4, max_bytes=10)
    assert len(taken) == 1


def test_revoke_returns_waiting_records_and_forgets_pause() -> None:
    bufs = PartitionBuffers(capacity=4, high_watermark=0.5, low_watermark=0.25)
    bufs.assign([A])
    bufs.push(rec(A, 0))
    bufs.push(rec(A, 1))
    assert A in bufs.paused
    dropped = bufs.revoke([A])
    assert [r.offset for r in dropped[A]] == [0, 1]
    assert A not in bufs.paused and A not in bufs.assigned
    # re-assignment gets a fresh, empty ring and an explicit resume
    assert bufs.assign([A]).resume == (A,)
    assert bufs.total() == 0


def _reference_take(
    rings: dict[TopicPartition, list[Record]], count: int, max_bytes: int | None, wait: tuple
) -> list[Record]:
    """Earliest deadline first, one record at a time (ties: the ring assigned first)."""
    order = list(rings)
    taken: list[Record] = []
    size = 0
    while len(taken) < count:

        def deadline(tp: TopicPartition) -> tuple[float, int]:
            return (min(r.consumed_at_s + wait[r.priority] for r in rings[tp]), order.index(tp))

        live = [tp for tp in order if rings[tp]]
        if not live:
            break
        tp = min(live, key=deadline)
        head = rings[tp][0]
        if max_bytes is not None and taken and size + head.size_bytes > max_bytes:
            break
        taken.append(rings[tp].pop(0))
        size += head.size_bytes
    return taken


def _random_rings(
    rng: random.Random, deadlines: bool, one_class: bool = False
) -> tuple[PartitionBuffers, dict[TopicPartition, list[Record]]]:
    """1-5 rings of up to 120 random records (sizes, consume times, priority classes; with
    ``deadlines``, half of them with a deadline in [0, 1) s, the rest none) and a plain-list
    mirror of what each ring kept. ``one_class``: each ring's records are of one class (its
    own, drawn per ring), half of them consumed in the same poll as the one before (equal
    consume times: ties between rings), some with a key or no value."""
    tps = [TopicPartition("t", p) for p in range(rng.randint(1, 5))]
    buffers = PartitionBuffers(64, 1.0, 0.0)
    buffers.assign(tps)
    mirror: dict[TopicPartition, list[Record]] = {tp: [] for tp in tps}
    ring_class = {tp: rng.choice((0, 1, 2)) for tp in tps}
    clock = 0.0
    for offset in range(rng.randint(1, 120)):
        if not one_class or rng.random() < 0.5:
            clock += rng.random() * 0.01
        tp = rng.choice(tps)
        deadline_s = rng.choice((math.inf, rng.random())) if deadlines else math.inf
        value = b"x" * rng.randint(1, 50)
        key = None
        priority = rng.choice((0, 1, 2))
        if one_class:
            priority = ring_class[tp]
            key = rng.choice((None, b"k" * rng.randint(1, 20)))
            value = rng.choice((value, value, None))
        record = Record(tp, offset, key, value, (), 0, clock, 1, priority, deadline_s=deadline_s)
        if buffers.push(record) is not None:
            mirror[tp].append(record)
    return buffers, mirror


@pytest.mark.parametrize("seed", range(40))
def test_take_matches_a_record_at_a_time_reference(seed: int) -> None:
    rng = random.Random(seed)
    wait = (0.002, 0.020, 0.050)
    buffers, mirror = _random_rings(rng, deadlines=False)
    while any(mirror.values()):
        count = rng.randint(1, 40)
        max_bytes = rng.choice((None, 200, 1000))
        expected = _reference_take(mirror, count, max_bytes, wait)
        got, _ = buffers.take(count, max_bytes, wait)
        assert [(r.tp, r.offset) for r in got] == [(r.tp, r.offset) for r in expected]


@pytest.mark.parametrize("seed", range(60))
def test_take_from_rings_of_one_class_matches_a_record_at_a_time_reference(seed: int) -> None:
    """A ring whose records are all of one class is cut a slice at a time
    (``RingBuffer._pop_slice``): the same records, in the same order, as popping one at a time,
    across rings of different classes, equal consume times (ties go to the ring assigned
    first), byte limits that stop a slice part-way and slot arrays that wrap around; the
    rings' sizes and bytes stay exact and no popped record stays referenced."""
    rng = random.Random(seed)
    wait = (0.002, 0.020, 0.050)
    buffers, mirror = _random_rings(rng, deadlines=False, one_class=True)
    tps = list(mirror)
    ring_class = {tp: (run[0].priority if run else 1) for tp, run in mirror.items()}
    clock, offset = 1.0, 1000
    for _ in range(30):  # takes between pushes: the rings' slot arrays wrap around
        count = rng.randint(1, 40)
        max_bytes = rng.choice((None, 30, 200, 1000))
        expected = _reference_take(mirror, count, max_bytes, wait)
        got, _ = buffers.take(count, max_bytes, wait)
        assert [(r.tp, r.offset) for r in got] == [(r.tp, r.offset) for r in expected]
        assert sorted((v.tp, v.size, v.bytes) for v in buffers.views()) == sorted(
            (tp, len(run), sum(r.size_bytes for r in run)) for tp, run in mirror.items() if run
        )
        # a popped record's slot is cleared: the ring keeps no reference to it
        for tp, ring in buffers._rings.items():
            assert sum(slot is not None for slot in ring._slots) == len(mirror[tp])
        for _ in range(rng.randint(0, 40)):
            clock += rng.choice((0.0, rng.random() * 0.01))
            tp = rng.choice(tps)
            offset += 1
            value = rng.choice((None, b"v" * rng.randint(1, 50)))
            record = Record(tp, offset, None, value, (), 0, clock, 1, ring_class[tp])
            if buffers.push(record) is not None:
                mirror[tp].append(record)


def _reference_take_live(
    rings: dict[TopicPartition, list[Record]],
    count: int,
    max_bytes: int | None,
    wait: tuple,
    now_s: float,
    max_expired: int,
) -> tuple[list[Record], list[Record]]:
    """Pop in :func:`_reference_take`'s order (the pops do not depend on which records
    expired); an expired record goes apart and counts against neither the count nor the
    bytes; stop at ``count`` live records, before a live record over the bytes (the first live
    one is always taken), or right after the ``max_expired``-th expired one."""
    live: list[Record] = []
    expired: list[Record] = []
    size = 0
    while len(live) < count:
        (head,) = _reference_take({tp: list(run) for tp, run in rings.items()}, 1, None, wait)
        if head.deadline_s > now_s:
            if max_bytes is not None and live and size + head.size_bytes > max_bytes:
                break
            live.append(head)
            size += head.size_bytes
        else:
            expired.append(head)
        rings[head.tp].pop(0)
        if len(expired) >= max_expired:
            break
        if not any(rings.values()):
            break
    return live, expired


@pytest.mark.parametrize("seed", range(40))
def test_take_live_matches_a_record_at_a_time_reference(seed: int) -> None:
    """Expired records set apart in the same pop order as :meth:`take`'s, never in a live
    record's place, and the rings left as the reference leaves them."""
    rng = random.Random(seed)
    wait = (0.002, 0.020, 0.050)
    buffers, mirror = _random_rings(rng, deadlines=True)  # now_s below is 0.5
    while any(mirror.values()):
        count = rng.randint(1, 12)
        max_bytes = rng.choice((None, 60, 200))
        max_expired = rng.randint(1, 10)
        expected = _reference_take_live(mirror, count, max_bytes, wait, 0.5, max_expired)
        got = buffers.take_live(count, max_bytes, wait, 0.5, max_expired)
        assert [(r.tp, r.offset) for r in got[0]] == [(r.tp, r.offset) for r in expected[0]]
        assert [(r.tp, r.offset) for r in got[1]] == [(r.tp, r.offset) for r in expected[1]]
        assert sum(v.bytes for v in buffers.views()) == sum(
            r.size_bytes for run in mirror.values() for r in run
        )


@pytest.mark.parametrize("seed", range(30))
def test_push_run_matches_a_list_model_of_the_rings(seed: int) -> None:
    """Runs pushed at once (across the slot array's wrap-around, into full rings) keep, refuse,
    pause, resume and cut as a model of plain lists says (record-at-a-time ``push`` is
    ``push_run`` of one record, so the model, not ``push``, is the reference)."""
    import random

    rng = random.Random(seed)
    wait = (0.002, 0.020, 0.050)
    tps = [TopicPartition("t", p) for p in range(rng.randint(1, 3))]
    capacity = rng.randint(1, 12)
    buffers = PartitionBuffers(capacity, 0.75, 0.25)
    buffers.assign(tps)
    mirror: dict[TopicPartition, list[Record]] = {tp: [] for tp in tps}
    paused: set[TopicPartition] = set()
    next_offset = dict.fromkeys(tps, 0)
    clock = 0.0
    for _ in range(rng.randint(5, 30)):
        tp = rng.choice(tps)
        clock += 0.001
        run = []
        for _ in range(rng.randint(1, 2 * capacity)):
            size = rng.randint(0, 40)
            run.append(
                Record(
                    tp, next_offset[tp], None, b"x" * size, (), 0, clock, 1, rng.choice((0, 1, 2))
                )
            )
            next_offset[tp] += 1
        kept, pause = buffers.push_run(tp, run)
        expected_kept = min(capacity - len(mirror[tp]), len(run))
        mirror[tp].extend(run[:expected_kept])
        expected_pause = len(mirror[tp]) >= buffers.high and tp not in paused
        if expected_pause or expected_kept < len(run):
            paused.add(tp)
        assert (kept, pause) == (expected_kept, expected_pause)
        assert buffers.paused == paused
        if kept < len(run):
            next_offset[tp] = run[kept].offset  # sought back to the first refused offset
        if rng.random() < 0.5:
            count, max_bytes = rng.randint(1, capacity), rng.choice((None, 30, 200))
            got, flow = buffers.take(count, max_bytes, wait)
            expected = _reference_take(mirror, count, max_bytes, wait)
            assert [(r.tp, r.offset) for r in got] == [(r.tp, r.offset) for r in expected]
            resumed = set(flow.resume)
            assert resumed <= paused and all(len(mirror[r]) <= buffers.low for r in resumed)
            paused -= resumed
            assert buffers.paused == paused
        assert [(v.tp, v.size, v.bytes) for v in buffers.views()] == [
            (tp, len(held), sum(r.size_bytes for r in held)) for tp, held in mirror.items() if held
        ]


def test_push_run_to_an_unassigned_partition_keeps_nothing() -> None:
    bufs = PartitionBuffers(capacity=4, high_watermark=1.0, low_watermark=0.0)
    bufs.assign([A])
    assert bufs.push_run(B, [rec(B, 0), rec(B, 1)]) == (0, False)
    assert bufs.total() == 0
