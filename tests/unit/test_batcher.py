from __future__ import annotations

import pytest

from streamproc.batcher import Batcher, Cut, Wait
from streamproc.buffers import PartitionBuffers
from streamproc.records import Record, TopicPartition

A = TopicPartition("t", 0)
B = TopicPartition("t", 1)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def fill(bufs: PartitionBuffers, tp: TopicPartition, at_s: list[float], size: int = 10) -> None:
    base = bufs.total()
    for i, t in enumerate(at_s):
        bufs.push(Record(tp, base + i, None, b"x" * size, (), 0, t, 1))


@pytest.fixture
def bufs() -> PartitionBuffers:
    b = PartitionBuffers(capacity=64, high_watermark=1.0, low_watermark=0.0)
    b.assign([A, B])
    return b


def test_no_messages_means_wait_without_deadline(bufs: PartitionBuffers) -> None:
    assert Batcher(4, 1 << 20, 10).decide(bufs.views(), 0.0) == Wait(None)


def test_cuts_on_size(bufs: PartitionBuffers) -> None:
    clock = FakeClock()
    fill(bufs, A, [clock.now_s] * 3)
    fill(bufs, B, [clock.now_s] * 2)
    assert Batcher(4, 1 << 20, 50).decide(bufs.views(), clock()) == Cut(4, "size")


def test_cuts_on_bytes(bufs: PartitionBuffers) -> None:
    fill(bufs, A, [100.0, 100.0], size=600)
    assert Batcher(8, 1000, 50).decide(bufs.views(), 100.0) == Cut(8, "bytes")


def test_deadline_counts_from_consume_time_not_from_now(bufs: PartitionBuffers) -> None:
    clock = FakeClock()
    batcher = Batcher(8, 1 << 20, max_wait_ms=20)
    fill(bufs, A, [clock.now_s - 0.015])  # consumed 15 ms ago
    decision = batcher.decide(bufs.views(), clock())
    assert isinstance(decision, Wait)
    assert decision.until_s == pytest.approx(clock.now_s + 0.005)
    clock.now_s += 0.005
    assert batcher.decide(bufs.views(), clock()) == Cut(8, "deadline")


def test_oldest_message_across_partitions_sets_the_deadline(bufs: PartitionBuffers) -> None:
    batcher = Batcher(8, 1 << 20, max_wait_ms=10)
    fill(bufs, A, [100.0])
    fill(bufs, B, [99.0])
    assert batcher.decide(bufs.views(), 99.011) == Cut(8, "deadline")


def test_zero_wait_cuts_immediately_and_never_empty(bufs: PartitionBuffers) -> None:
    batcher = Batcher(8, 1 << 20, max_wait_ms=0)
    assert batcher.decide(bufs.views(), 1.0) == Wait(None)
    fill(bufs, A, [1.0])
    assert batcher.decide(bufs.views(), 1.0) == Cut(8, "deadline")
    taken, _ = bufs.take(8)
    assert len(taken) == 1


def test_rejects_nonpositive_batch_size() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        Batcher(0, 1, 1)
